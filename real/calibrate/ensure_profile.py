"""Hydra callback for `+sweep=validate` (conf/sweep/validate.yaml's ``_target_``): make sure a
latency profile exists before any job runs. It lives in real/ because only the real backend
measures; testbed imports no backend module.

The simulator's `profile` cost model reads reports/profiles/<hardware>.json (real/calibrate/profile.py
writes it). When the sweep starts and the profile is missing, was measured with other threads
or dtype, lacks a draft that can run here, or lacks what a job of the sweep will read from it
(``ProfileNeeds``: the models and TP degrees of every job the profile predicts, as the pre-run
check saw them, testbed.app.sweeps.checked_jobs), or ``force`` is set, calibration runs first (a
few minutes), in the sweep's process, so one command does everything. What cannot be measured
here (a TP degree above the cores this process may use, e.g. under `taskset`) stops the sweep
with one line, exit code 2, before any job runs.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.compose import to_experiment
from testbed.config import ExperimentConfig, real_dtype
from testbed.paths import CONF_DIR, TIMED_CODE, repo_path, timed_code_digest
from testbed.schedules import spec_of

CALIBRATE_CMD = "python -m testbed backend=real +calibrate"


@dataclass
class ProfileNeeds:
    """What the jobs of a sweep will read from the latency profile."""

    models: set[str] = field(default_factory=set)  # every model a prediction charges
    tp: dict[str, set[int]] = field(default_factory=dict)  # model (whose TP tables) -> degrees > 1
    threads: set[int] = field(default_factory=set)  # the jobs' real.threads (0: torch's default, free)

    @property
    def cores(self) -> int:
        """The cores a calibration needs to measure every TP degree (one worker per core)."""
        return max((d for ds in self.tp.values() for d in ds), default=1)


def reads_profile(exp: ExperimentConfig, hardware: str) -> bool:
    """Whether the job ``exp`` predicts from the latency profile of ``hardware``."""
    return exp.backend == "sim" and exp.sim.cost_model == "profile" and exp.hardware.name == hardware


def profile_needs(exps: Iterable[ExperimentConfig], hardware: str) -> ProfileNeeds:
    """What ``exps`` (a sweep's jobs) need from the profile of ``hardware``: the predictions
    (`backend=sim sim.cost_model=profile`) their models and TP degrees (an early-exit draft reads
    the target's TP tables, an n-gram draft none), and every job its thread count."""
    from testbed.placement import PlacementError, tp_degrees

    needs = ProfileNeeds()
    for exp in exps:
        if exp.hardware.name != hardware:
            continue
        if exp.real.threads:
            needs.threads.add(exp.real.threads)
        if not reads_profile(exp, hardware):
            continue
        try:
            degrees = tp_degrees(exp)
        except PlacementError:  # the pre-run check names a bad placement; nothing to measure
            continue
        for role in ("target", "draft") if spec_of(exp).drafts else ("target",):
            m = getattr(exp.pair, role)
            needs.models.add(m.name)
            tables = exp.pair.target.name if m.kind == "early_exit" else m.name
            if m.kind != "ngram" and degrees[role] > 1:
                needs.tp.setdefault(tables, set()).add(degrees[role])
    return needs


def covers(prof: dict[str, Any], needs: ProfileNeeds) -> tuple[bool, str]:
    """Whether a profile (its JSON) has what ``needs`` says the jobs read (and what it lacks)."""
    if len(needs.threads) > 1:
        return False, (f"the jobs run at real.threads {sorted(needs.threads)} and one profile is "
                       "measured at one: sweep them separately")
    if needs.threads and prof.get("threads") not in needs.threads:
        return False, f"profile threads {prof.get('threads')} != real.threads={min(needs.threads)}"
    models = prof.get("models", {})
    missing = sorted(needs.models - set(models))
    if missing:
        return False, f"profile lacks {', '.join(missing)}"
    cores = f"measured on {_cores(prof['cores'])}" if prof.get("cores") else "measured on fewer cores?"
    for name, degrees in sorted(needs.tp.items()):
        tables = models.get(name, {}).get("tp") or {}
        lack = sorted(d for d in degrees if str(d) not in tables or "1" not in tables)
        if lack:
            return False, f"profile has no TP {', '.join(map(str, lack))} tables of {name} ({cores})"
    return True, "current"


def _cores(n: int) -> str:
    return f"{n} core" + ("" if n == 1 else "s")


def cannot_measure(needs: ProfileNeeds, why: str) -> str | None:
    """The one-line reason this process cannot measure what ``needs`` asks (None: it can)."""
    cores = len(os.sched_getaffinity(0))
    if len(needs.threads) > 1:
        return f"the sweep's latency profile: {why}"
    if needs.cores > cores:
        return (f"the latency profile does not serve this sweep's predictions ({why}) and this "
                f"process may use {_cores(cores)} (taskset?), too few to measure TP {needs.cores}: "
                f"run the sweep where it may use {needs.cores} cores, or measure the profile there "
                f"first with `{CALIBRATE_CMD}`")
    return None


def profile_is_current(path: Path, exp: ExperimentConfig,
                       needs: ProfileNeeds | None = None) -> tuple[bool, str]:
    """Whether the profile at `path` serves `exp` and, given ``needs``, every job of its sweep
    (and why not)."""
    if not path.exists():
        return False, "no profile yet"
    try:
        prof = json.loads(path.read_text())
    except ValueError:
        return False, "unreadable profile"
    from real.calibrate.profile import SCHEMA, drafts_to_measure

    if prof.get("schema") != SCHEMA:
        return False, f"profile schema {prof.get('schema')} != {SCHEMA}"
    if prof.get("code") != timed_code_digest():  # kernels, models or the speculative algorithms changed
        return False, (f"profile measured with other code of {', '.join(TIMED_CODE)} (digest "
                       f"{prof.get('code')} != {timed_code_digest()} now): its tables time what changed")
    if prof.get("dtype") != real_dtype(exp):
        return False, f"profile dtype {prof.get('dtype')} != real.dtype={exp.real.dtype} ({real_dtype(exp)} here)"
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
    if no_async:  # a tree's per-round select and re-root (real/calibrate/tree.time_bookkeeping)
        return False, f"profile has no tree bookkeeping table of {', '.join(no_async)}"
    unbatched = [m.name for m in models if m.kind in ("transformer", "eagle") and "batch" not in prof["models"][m.name]]
    if unbatched:  # serving under load (real/calibrate/batch.py); an eagle head's tree forwards too
        return False, f"profile has no batched-forward table of {', '.join(unbatched)}"
    no_tree = [m.name for m in models if m.kind == "eagle" and "tree_expand" not in prof["models"][m.name]]
    if no_tree:  # an eagle head's tree expansions beyond its forward (real/calibrate/tree.py)
        return False, f"profile has no tree expansion table of {', '.join(no_tree)}"
    contended = any("contended" in m for m in prof["models"].values())
    if contended and "bridge" not in prof.get("links", {}):  # measured beside it on 2 cores
        return False, "profile has no async bridge message table (real/calibrate/bridge.py)"
    return covers(prof, needs) if needs is not None else (True, "current")


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
    """``hardware``: measure only for sweeps with a job on this hardware (`+sweep=gpu_split`
    predicts published nodes from the roofline and this machine from the profile; `+sweep=load`'s
    `local` grid runs on it under a base config on published nodes); ``backend``: only for
    sweeps on this backend (`+sweep=wan`: real only)."""

    def __init__(self, force: bool = False, backend: str | None = None, hardware: str | None = None) -> None:
        self.force, self.backend, self.hardware = force, backend, hardware

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import sys

        if self.backend is not None and config.get("backend") != self.backend:
            return

        from real.calibrate.profile import calibrate, profile_path
        from testbed.app.sweeps import checked_jobs

        base = to_experiment(config)
        jobs = checked_jobs(config) or [base]
        hardware = self.hardware or base.hardware.name
        if self.hardware is not None and not any(j.hardware.name == hardware for j in jobs):
            return
        missing = missing_draft_weights(swept_pairs(config))
        if missing:  # fail before minutes of calibration, not in the middle of the sweep
            print("error: " + "; ".join(missing) + " — train/copy them, or choose the pairs "
                  "with pair=A,B on the command line", file=sys.stderr)
            raise SystemExit(2)
        needs = profile_needs(jobs, hardware)
        # measured for a job that reads it (the base config's pair may be no job's: gpu_split)
        exp = copy.deepcopy(next((j for j in jobs if reads_profile(j, hardware)), base))
        exp.backend, exp.calibrate = "real", False
        path = profile_path(exp)
        ok, why = profile_is_current(path, exp, needs)
        if ok and not self.force:
            print(f"latency profile: {path}")
            return
        refuse = cannot_measure(needs, why)
        if refuse:
            print(f"error: {refuse}", file=sys.stderr)
            raise SystemExit(2)
        print(f"latency profile: measuring ({'forced' if self.force else why}) ...")
        sweep_dir = Path(config.hydra.sweep.dir)
        if needs.threads:
            exp.real.threads = min(needs.threads)
        calibrate(exp, sweep_dir / "calibration")
        ok, why = profile_is_current(path, exp, needs)
        if not ok:  # measured, yet short of what a job reads: stop before the jobs fail one by one
            print(f"error: the latency profile measured now ({path}) still does not serve this "
                  f"sweep: {why} (the calibration's lines above say what it skipped)", file=sys.stderr)
            raise SystemExit(2)
