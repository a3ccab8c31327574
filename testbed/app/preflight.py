"""Check the command line before Hydra runs anything.

Every bad value — an unknown preset, a key that does not exist, a value of the wrong type, a
value out of range, an impossible placement, a setting no job would use, an output directory
that cannot be created — stops here with one line naming the key, the value and what is
allowed, and exit code 2, before anything is written. For a multirun every job is checked
first, so a bad value in job 17 cannot leave 16 half-compared results behind.

Speed: Hydra composes a configuration in ~0.1 s, too slow for 60 jobs. A sweep is composed
once per combination of its *group* choices (`pair=`, `+split=`); its plain value axes
(`schedule.tau=0,0.1`) are applied to a copy of that job's typed experiment and validated.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import itertools
import re
import sys
import typing
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed.app.compose_cache import shared_config_cache
from testbed.app.grids import grid_job_count, sweep_grids
from testbed.app.unused_settings import unused_for, unused_settings
from testbed.compose import pairs_named, register_configs, to_experiment
from testbed.config import ConfigError, ExperimentConfig
from testbed.config_validate import validate
from testbed.paths import CONF_DIR

MAX_JOBS_CHECKED = 2000
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class PreflightError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# the schema: keys, types, suggestions


def group_options(group: str) -> list[str]:
    from hydra.core.config_store import ConfigStore

    names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    if group == "schedule":  # and the schedules of plug-ins (testbed.schedules)
        from testbed.schedules import schedule_names

        names |= set(schedule_names())
    node = ConfigStore.instance().repo.get(group)
    if isinstance(node, dict):
        names |= {k.removesuffix(".yaml") for k in node}
    return sorted(names)


def config_groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


@functools.cache
def schema_types() -> dict[str, Any]:
    """Every dotted key of the experiment schema -> its annotated type."""
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = t
    walk(ExperimentConfig, "")
    return out


def suggest(key: str) -> str:
    """`; did you mean X?` for a misspelt key or group, else ''."""
    candidates = [*schema_types(), *config_groups()]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if not close:  # a misspelt last part: schedule.gama -> schedule.gamma
        head, _, tail = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in candidates if k.rpartition(".")[0] == head]
        close = [f"{head}.{m}" for m in difflib.get_close_matches(tail, siblings, n=1, cutoff=0.6)]
    return f"; did you mean {close[0]}?" if close else ""


def no_such_setting(key: str) -> str:
    return f"{key}: no such setting{suggest(key)} (groups and keys: python -m testbed --help)"


def type_words(t: Any) -> str:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    base = args[0] if args else t
    words = TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))
    return words + (" or null" if type(None) in typing.get_args(t) else "")


def coerce(key: str, raw: Any) -> Any:
    """A command-line value -> the schema's type, or ConfigError keeping the expected type."""
    t = schema_types()[key]
    optional = type(None) in typing.get_args(t)
    base = next((a for a in typing.get_args(t) if a is not type(None)), t)
    if raw is None or (isinstance(raw, str) and raw.lower() == "null"):
        if optional:
            return None
        raise ConfigError(key, raw, type_words(t))
    text = str(raw)
    try:
        if base is bool:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            raise ValueError
        if base is int:
            if isinstance(raw, float) or not re.fullmatch(r"[+-]?\d+", text.strip()):
                raise ValueError
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
    except ValueError:
        raise ConfigError(key, raw, type_words(t)) from None
    raise ConfigError(key, raw, f"set in a config file ({type_words(t)})")


def apply_value(exp: ExperimentConfig, key: str, raw: Any) -> None:
    *path, last = key.split(".")
    obj: Any = exp
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, coerce(key, raw))


# ---------------------------------------------------------------------------------------------
# Hydra's errors -> one line


def _one_line(exc: BaseException, overrides: list[str]) -> str:
    msg = str(exc)
    if isinstance(exc, MissingConfigException) or "Could not find" in msg or "Could not load" in msg:
        m = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", msg)
        if m:
            group, value = m.group(1), m.group(2)
            if group == "pair":
                models = group_options("model")
                return (f"pair={value} is not a known pair: use TARGET+DRAFT with TARGET and DRAFT "
                        f"among {', '.join(models)}")
            opts = group_options(group)
            close = difflib.get_close_matches(value, opts, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"{group}={value} is not allowed: one of {', '.join(opts)}{hint}"
    full_key = re.search(r"full_key:\s*(\S+)", msg)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    if re.search(r"Key '([^']+)' not in '(\w+)'", msg) and full_key:
        return no_such_setting(full_key.group(1))
    if "Could not override" in msg or "Could not append to config" in msg or "Could not delete" in msg:
        k = re.search(r"Could not (?:override|append to config|delete)[^']*'([^']+)'", msg)
        return no_such_setting(k.group(1) if k else "?")
    if full_key:
        key = full_key.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), "?")
        if key in schema_types():
            return f"{key}={value!r} is not allowed: {type_words(schema_types()[key])}"
        return f"{key}={value!r} is not allowed: {first}"
    return first


def _compose(overrides: list[str]):  # type: ignore[no-untyped-def]
    try:
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise PreflightError(_one_line(e, overrides)) from None


def _experiment(cfg: Any, overrides: list[str]) -> ExperimentConfig:
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # values may use ${hydra:...}
    try:
        return to_experiment(cfg)
    except ConfigError as e:
        raise PreflightError(str(e)) from None
    except (OmegaConfBaseException, ValueError) as e:
        raise PreflightError(_one_line(e, overrides)) from None


def _validate(exp: ExperimentConfig) -> ExperimentConfig:
    try:
        return validate(exp)
    except ConfigError as e:
        raise PreflightError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# output directories


def check_output_dir(key: str, value: str) -> None:
    """The run/sweep directory can be created: no part of it is a file, its parent writable."""
    import os

    p = Path(value)
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise PreflightError(f"{key}={value}: {parent} is a file, not a directory; "
                                     "choose another path")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PreflightError(f"{key}={value}: {parent} is not writable; choose another path")
            return


# ---------------------------------------------------------------------------------------------
# the check


def _interpolated_keys(cfg: Any) -> set[str]:
    text = str(OmegaConf.to_container(cfg, resolve=False))
    return set(re.findall(r"\$\{([\w.]+)\}", text))


def _known_key(key: str) -> bool:
    """A schema key, a node above keys (`pair.target`), or an entry of a dict-valued key."""
    types = schema_types()
    if key in types or any(k.startswith(key + ".") for k in types):
        return True
    parts = key.split(".")
    return any(typing.get_origin(types.get(".".join(parts[:i]))) is dict for i in range(1, len(parts)))


def _is_group(key: str) -> bool:
    return key.split("/")[0] in config_groups() or "/" in key or key.startswith("hydra")


def _check_unused(user_keys: list[str], exps: list[ExperimentConfig]) -> None:
    """A command-line setting that no job uses is an error naming what would use it."""
    unused = [unused_settings(e) for e in exps]
    for key in user_keys:
        whys = [unused_for(key, u) for u in unused]
        if whys and all(whys):
            raise PreflightError(f"{key} has no effect here: it is used by {whys[0]} "
                                 "(remove it, or choose that setting)")


def command_pairs(args: list[str]) -> set[str]:
    """The pair combinations a command can compose: on its command line and in conf/ files."""
    texts = list(args)
    for sub in ("sweep", "validate", "backend", "split"):
        texts += [p.read_text() for p in (CONF_DIR / sub).glob("*.yaml")]
    return pairs_named(texts)


def preflight(args: list[str], composed: dict[str, Any] | None = None, warm_pool: bool = False) -> int:
    """Raise PreflightError with a one-line message if any job of this command is invalid;
    return the number of jobs. For a single run, `composed["cfg"]` receives its composed
    configuration (hydra node included), so the run need not be composed a second time."""
    register_configs(command_pairs(args))
    overrides = [a for a in args if not a.startswith("-")]
    multirun = any(a in ("-m", "--multirun") for a in args)
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException as e:
        raise PreflightError(f"cannot parse the command line: {str(e).splitlines()[0]}") from None
    for o in parsed:  # unknown keys, before Hydra's less helpful messages
        key = o.get_key_element().lstrip("+~")
        if not _is_group(key) and not _known_key(key):
            raise PreflightError(no_such_setting(key))
        if key in schema_types() and not o.is_sweep_override() and not o.is_delete():
            try:  # the expected type in the message (Hydra's says only "Error merging override")
                coerce(key, o.value())
            except ConfigError as e:
                raise PreflightError(str(e)) from None
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = {o.get_key_element(): o for o in parsed if o.is_sweep_override()}
    user_keys = [o.get_key_element().lstrip("+~") for o in parsed
                 if not o.get_key_element().lstrip("+~").startswith(("hydra", "sweep"))]
    # one config cache for all the check's compositions (testbed/app/compose_cache.py), unless the
    # command moves Hydra's search path (then the files loaded may differ between compositions)
    cache = shared_config_cache() if not any("searchpath" in o for o in overrides) else contextlib.nullcontext()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None), cache:
        cfg = _compose(plain)
        if cfg.hydra.mode is not None and str(cfg.hydra.mode) == "RunMode.MULTIRUN":
            multirun = True
        if not multirun:
            if sweeps:
                k = next(iter(sweeps))
                raise PreflightError(f"{k}: several values given; add --multirun (-m) to sweep them")
            exp = _validate(_experiment(cfg, plain))
            check_output_dir("hydra.run.dir", str(cfg.hydra.run.dir))
            _check_unused(user_keys, [exp])
            if composed is not None:
                composed["cfg"] = cfg
            return 1
        check_output_dir("hydra.sweep.dir", str(cfg.hydra.sweep.dir))
        if warm_pool:  # the joblib launcher's workers import while the jobs are checked
            from testbed.app.worker_pool import warm

            warm(cfg.hydra.launcher, str(cfg.backend))
        exps: list[ExperimentConfig] = []
        n = 0
        for params in sweep_grids(cfg.hydra.sweeper):
            n += _check_grid(cfg, params, sweeps=dict(sweeps), parsed=parsed, plain=plain, parser=parser, exps=exps, checked=n)
        _check_unused(user_keys, exps)
        from testbed.app.sweeps import remember_jobs

        remember_jobs(cfg, exps)  # what each job needs (real.calibrate.ensure_profile)
        try:
            return grid_job_count(cfg, args) or n
        except ValueError as e:  # e.g. +sweep=gpu_split on hardware it has no grid for
            raise PreflightError(str(e)) from None


def _check_grid(cfg: Any, params: dict[str, Any], *, sweeps: dict[str, Any], parsed: list, plain: list[str],  # type: ignore[type-arg]
                parser: Any, exps: list[ExperimentConfig], checked: int) -> int:
    """Validate the jobs of one grid (appended to ``exps``); returns how many it has."""
    plain_keys = {o.get_key_element() for o in parsed if not o.is_sweep_override()}
    for key, value in params.items():
        if key not in sweeps and key not in plain_keys:
            sweeps[key] = parser.parse_override(f"{key}={value}")
    group_axes, value_axes = [], []
    for key, o in sweeps.items():
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
        bare = key.lstrip("+~")
        if _is_group(bare):
            group_axes.append([f"{key}={v}" for v in values])
        elif bare not in schema_types():
            raise PreflightError(no_such_setting(bare))
        else:
            value_axes.append([(bare, v) for v in values])
    needs_compose = _interpolated_keys(cfg) & {axis[0][0] for axis in value_axes}
    n = 0
    for groups in itertools.product(*group_axes):
        gcfg = _compose(plain + list(groups)) if groups else cfg
        base = _experiment(gcfg, plain + list(groups))
        for values in itertools.product(*value_axes):
            if checked + n >= MAX_JOBS_CHECKED:
                break
            n += 1
            if needs_compose:  # a swept value feeds an interpolation: compose this job
                job = plain + list(groups) + [f"{k}={v}" for k, v in values]
                exp = _experiment(_compose(job), job)
            else:
                exp = copy.deepcopy(base)
                try:
                    for k, v in values:
                        apply_value(exp, k, v)
                except ConfigError as e:
                    raise PreflightError(str(e)) from None
            exps.append(_validate(exp))
    return n


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


def main_guard(args: list[str], composed: dict[str, Any] | None = None) -> int:
    try:
        return preflight(args, composed, warm_pool=True)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        from testbed.app.worker_pool import shutdown

        shutdown()  # the workers (and their fork server) started for the jobs that won't run
        raise SystemExit(2) from None
