"""Check the command line before Hydra runs anything.

Every bad value — an unknown preset, a key that does not exist, a value of the wrong type, a
value out of range, an impossible placement — stops here with one line naming the key, the
value and what is allowed, and exit code 2. For a multirun every job of the sweep is composed
and validated first, so a bad value in job 17 cannot leave 16 half-compared results behind.
"""

from __future__ import annotations

import itertools
import re
import sys

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from testbed.config import ConfigError, register_configs, to_experiment, validate
from testbed.paths import CONF_DIR

MAX_JOBS_CHECKED = 2000


class PreflightError(Exception):
    pass


def group_options(group: str) -> list[str]:
    from hydra.core.config_store import ConfigStore

    names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    node = ConfigStore.instance().repo.get(group)
    if isinstance(node, dict):
        names |= {k.removesuffix(".yaml") for k in node}
    return sorted(names)


def _one_line(exc: BaseException, overrides: list[str]) -> str:
    msg = str(exc)
    if isinstance(exc, MissingConfigException) or "Could not find" in msg or "Could not load" in msg:
        m = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", msg)
        if m:
            group, value = m.group(1), m.group(2)
            opts = group_options(group)
            if group == "pair":
                models = group_options("model")
                return (f"pair={value} is not a known pair: use TARGET+DRAFT with TARGET and DRAFT "
                        f"among {', '.join(models)}")
            return f"{group}={value} is not allowed: one of {', '.join(opts)}"
    full_key = re.search(r"full_key:\s*(\S+)", msg)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    key_missing = re.search(r"Key '([^']+)' not in '(\w+)'", msg)
    if key_missing and full_key:
        return f"{full_key.group(1)}: no such setting (check the spelling; see conf/ and README)"
    if "Could not override" in msg:
        k = re.search(r"Could not override '([^']+)'", msg)
        return f"{k.group(1) if k else '?'}: no such setting (check the spelling; see conf/ and README)"
    if full_key:
        key = full_key.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), "?")
        return f"{key}={value!r} is not allowed: {first}"
    return first


def _split_overrides(args: list[str]) -> tuple[list[str], bool]:
    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides = [a for a in args if not a.startswith("-")]
    return overrides, multirun


def _compose(overrides: list[str]):  # type: ignore[no-untyped-def]
    try:
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise PreflightError(_one_line(e, overrides)) from None


def _check(overrides: list[str]) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = _compose(overrides)
    HydraConfig.instance().set_config(cfg)  # values may use ${hydra:...} (validate: sweep dir)
    try:
        validate(to_experiment(cfg))
    except ConfigError as e:
        raise PreflightError(str(e)) from None
    except (OmegaConfBaseException, ValueError) as e:
        raise PreflightError(_one_line(e, overrides)) from None


def preflight(args: list[str]) -> None:
    """Raise PreflightError with a one-line message if any job of this command is invalid."""
    register_configs()
    overrides, multirun = _split_overrides(args)
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException as e:
        raise PreflightError(f"cannot parse the command line: {str(e).splitlines()[0]}") from None
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = {o.get_key_element(): o for o in parsed if o.is_sweep_override()}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = _compose(plain)
        if cfg.hydra.mode is not None and str(cfg.hydra.mode) == "RunMode.MULTIRUN":
            multirun = True
        if not multirun:
            if sweeps:
                k = next(iter(sweeps))
                raise PreflightError(f"{k}: several values given; add --multirun (-m) to sweep them")
            _check(plain)
            return
        params = dict(cfg.hydra.sweeper.get("params") or {})
        plain_keys = {o.get_key_element() for o in parsed if not o.is_sweep_override()}
        for key, value in params.items():
            if key not in sweeps and key not in plain_keys:
                sweeps[key] = parser.parse_override(f"{key}={value}")
        axes = []
        for key, o in sweeps.items():
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
            axes.append([f"{key}={v}" for v in values])
        for n, combo in enumerate(itertools.product(*axes)):
            if n >= MAX_JOBS_CHECKED:
                break
            _check(plain + list(combo))


def normalize_args(args: list[str]) -> list[str]:
    """`+calibrate` (a flag) -> `calibrate=true`; `+calibrate=X` -> `calibrate=X` (a schema key)."""
    out = []
    for a in args:
        if a in ("+calibrate", "calibrate", "++calibrate"):
            a = "calibrate=true"
        elif a.startswith(("+calibrate=", "++calibrate=")):
            a = a.lstrip("+")
        out.append(a)
    return out


def main_guard(args: list[str]) -> None:
    try:
        preflight(args)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
