"""Hydra callback for `+sweep=validate` (conf/sweep/validate.yaml's ``_target_``): make sure a
latency profile exists before any job runs. It lives in real/ because only the real backend
measures; testbed imports no backend module.

The simulator's `profile` cost model reads reports/profiles/<hardware>.json (real/calibrate.py
writes it). When the sweep starts and the profile is missing, was measured with other threads
or dtype, lacks a draft that can run here, or ``force`` is set, calibration runs first (a few
minutes), in the sweep's process, so one command does everything.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.config import ExperimentConfig, to_experiment
from testbed.paths import CONF_DIR, repo_path


def profile_is_current(path: Path, exp: ExperimentConfig) -> tuple[bool, str]:
    """Whether the profile at `path` serves `exp` (and why not)."""
    if not path.exists():
        return False, "no profile yet"
    try:
        prof = json.loads(path.read_text())
    except ValueError:
        return False, "unreadable profile"
    from real.calibrate import SCHEMA, drafts_to_measure

    if prof.get("schema") != SCHEMA:
        return False, f"profile schema {prof.get('schema')} != {SCHEMA}"
    if prof.get("dtype") != exp.real.dtype:
        return False, f"profile dtype {prof.get('dtype')} != real.dtype={exp.real.dtype}"
    if exp.real.threads and prof.get("threads") != exp.real.threads:
        return False, f"profile threads {prof.get('threads')} != real.threads={exp.real.threads}"
    if not prof.get("probe", {}).get("gbps"):
        return False, "profile has no bandwidth probe (the predictions' sim.profile_drift=probe needs it)"
    models = [exp.pair.target, *drafts_to_measure(exp)]
    missing = [m.name for m in models if m.name not in prof.get("models", {})]
    if missing:
        return False, f"profile lacks {', '.join(missing)}"
    forward = prof.get("probe", {}).get("forward_s") or {}
    unprobed = [m.name for m in models if m.kind != "ngram" and m.name not in forward]
    if unprobed:  # the predictions' sim.profile_drift=forward
        return False, f"profile has no forward probe of {', '.join(unprobed)}"
    no_async = [m.name for m in models if "tree_expand" in prof["models"][m.name]
                and "tree_rounds" not in prof["models"][m.name]]
    if no_async:  # a tree's per-round select and re-root (real/calibrate_tree.time_bookkeeping)
        return False, f"profile has no tree bookkeeping table of {', '.join(no_async)}"
    contended = any("contended" in m for m in prof["models"].values())
    if contended and "bridge" not in prof.get("links", {}):  # measured beside it on 2 cores
        return False, "profile has no async bridge message table (real/calibrate_bridge.py)"
    return True, "current"


def swept_pairs(config: DictConfig) -> list[str]:
    """The pairs a multirun will run: the command line's `pair=` if given, else the sweep's."""
    for o in config.hydra.overrides.get("task", []):
        if str(o).startswith("pair="):
            return str(o).split("=", 1)[1].split(",")
    sweeper = config.hydra.sweeper
    values = [(sweeper.get("params") or {}).get("pair")]
    only = list(sweeper.get("only") or []) or None  # the grids that run (hydra_plugins.specbed_sweeper)
    values += [(g or {}).get("pair") for name, g in (sweeper.get("grids") or {}).items()
               if only is None or name in only]
    return list(dict.fromkeys(p for v in values if v for p in str(v).split(",")))


def missing_draft_weights(pairs: list[str]) -> list[str]:
    """`pair=... : reason` for every pair whose draft model has no weights here."""
    from omegaconf import OmegaConf

    from testbed.config import ModelConfig

    conf = CONF_DIR / "model"
    out = []
    for pair in pairs:
        draft = pair.strip().split("+", 1)[-1]
        f = conf / f"{draft}.yaml"
        if not f.exists():
            continue  # preflight names unknown presets
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(f))
        if m.kind == "transformer" and (m.path is None or not repo_path(m.path).exists()):
            out.append(f"pair={pair.strip()}: the draft's weights ({m.path}) are not here")
    return out


class EnsureProfile(Callback):
    """``hardware``: measure only for sweeps on this hardware (`+sweep=gpu_split` predicts
    published nodes from the roofline and this machine from the profile); ``backend``: only for
    sweeps on this backend (`+sweep=wan`: real only)."""

    def __init__(self, force: bool = False, backend: str | None = None, hardware: str | None = None) -> None:
        self.force, self.backend, self.hardware = force, backend, hardware

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import sys

        if self.backend is not None and config.get("backend") != self.backend:
            return

        from real.calibrate import calibrate, profile_path

        if self.hardware is not None and config.hardware.name != self.hardware:
            return
        missing = missing_draft_weights(swept_pairs(config))
        if missing:  # fail before minutes of calibration, not in the middle of the sweep
            print("error: " + "; ".join(missing) + " — train/copy them, or choose the pairs "
                  "with pair=A,B on the command line", file=sys.stderr)
            raise SystemExit(2)
        exp = copy.deepcopy(to_experiment(config))
        exp.backend = "real"
        path = profile_path(exp)
        ok, why = profile_is_current(path, exp)
        if ok and not self.force:
            print(f"latency profile: {path}")
            return
        print(f"latency profile: measuring ({'forced' if self.force else why}) ...")
        sweep_dir = Path(config.hydra.sweep.dir)
        calibrate(exp, sweep_dir / "calibration")
