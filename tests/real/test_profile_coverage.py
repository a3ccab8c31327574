"""Does the latency profile serve every job of a sweep? (real/calibrate/ensure_profile.py, fabricated
profiles, nothing measured): the pre-run check collects what each job will read — models, the TP
degrees of its predictions, threads — and a profile that lacks any of it is measured again, or
refused with one line when this process cannot measure it, before any job runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from real.calibrate.ensure_profile import (
    ProfileNeeds,
    cannot_measure,
    covers,
    profile_is_current,
    profile_needs,
)
from real.calibrate.profile import PROFILE_THREADS, SCHEMA, drafts_to_measure
from testbed.app.preflight import preflight
from testbed.app.sweeps import checked_jobs
from testbed.config import real_dtype
from tests.conftest import ROOT, compose_exp
from tests.sim.test_cost_profile_tp import BATCH_TABLES, TABLES, profile_with_tp

PAIR = "pair=smollm2_135m+smollm2_draft"


def sweep_jobs(*args: str) -> list:  # type: ignore[type-arg]
    """The jobs of a sweep as the pre-run check saw them (nothing runs)."""
    from omegaconf import OmegaConf

    preflight(list(args))
    jobs = checked_jobs(OmegaConf.create({"hydra": {"sweep": {"dir": next(
        a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir="))}}}))
    assert jobs
    return jobs


def full_profile(exp, tp: bool = True, threads: int = PROFILE_THREADS, cores: int = 2) -> dict:  # type: ignore[no-untyped-def]
    """A profile with every table profile_is_current asks for (TP 1 and 2 unless ``tp=False``:
    what a calibration on one core writes)."""
    prof = profile_with_tp()
    for d in drafts_to_measure(exp):
        prof["models"].setdefault(d.name, {**prof["models"]["smollm2_exit10"], "kind": d.kind})
    for m in prof["models"].values():
        m.pop("tp", None)
        if tp and m["kind"] == "transformer":
            m["tp"] = TABLES
        if m["kind"] in ("transformer", "eagle"):
            m["batch"] = BATCH_TABLES
    prof.update(schema=SCHEMA, dtype=real_dtype(exp), threads=threads, cores=cores,
                probe={"gbps": 10.0, "forward_s": {name: 0.01 for name in prof["models"]}})
    return prof


def test_the_gpu_split_sweep_needs_tp2_tables_of_both_models(tmp_path: Path) -> None:
    """+sweep=gpu_split backend=real predicts sync and the serial tree on both cores: TP 2 of the
    target and the draft model; async and ar at TP 1; every job at one thread."""
    needs = profile_needs(sweep_jobs("+sweep=gpu_split", "backend=real", f"hydra.sweep.dir={tmp_path}"),
                          "local")
    assert needs.tp == {"smollm2_135m": {2}, "smollm2_draft": {2}}
    assert {"smollm2_135m", "smollm2_draft"} <= needs.models and needs.threads == {1}
    assert needs.cores == 2


@pytest.mark.parametrize("sweep", ["validate", "gpu_split", "wan"])
def test_a_default_calibration_has_the_threads_of_the_readme_sweeps(sweep: str, tmp_path: Path) -> None:
    """`backend=real +calibrate` (real.threads unset) measures at PROFILE_THREADS; the sweeps the
    README runs next read a profile of exactly that many threads (before: 2 against 1, so the
    sweep measured everything again)."""
    needs = profile_needs(sweep_jobs(f"+sweep={sweep}", "backend=real", f"hydra.sweep.dir={tmp_path}"),
                          "local")
    assert needs.threads == {PROFILE_THREADS}
    assert compose_exp("backend=real").real.threads == 0  # unset: +calibrate picks PROFILE_THREADS


def test_a_one_core_profile_does_not_serve_a_sweep_that_predicts_tp2(tmp_path: Path) -> None:
    """The profile a one-core calibration wrote (`taskset -c 1`: no TP tables) serves the
    validate sweep's chain grid (TP 1) but not gpu_split (TP 2): that is known before any job
    runs, with the model and the degree."""
    exp = compose_exp(PAIR, "hardware=local", "backend=real", "real.threads=1")
    path = tmp_path / "local.json"
    path.write_text(json.dumps(full_profile(exp, tp=False, cores=1)))
    gpu_split = profile_needs(sweep_jobs("+sweep=gpu_split", "backend=real",
                                         f"hydra.sweep.dir={tmp_path / 'g'}"), "local")
    validate = profile_needs(sweep_jobs("+sweep=validate", "backend=real", "hydra.sweeper.only=[base]",
                                        f"hydra.sweep.dir={tmp_path / 'v'}"), "local")
    assert profile_is_current(path, exp) == (True, "current")  # the old check: accepted
    assert profile_is_current(path, exp, validate) == (True, "current")
    ok, why = profile_is_current(path, exp, gpu_split)
    assert not ok and "TP 2" in why and "smollm2_135m" in why and "1 core" in why
    path.write_text(json.dumps(full_profile(exp, tp=True)))
    assert profile_is_current(path, exp, gpu_split) == (True, "current")


def test_coverage_names_threads_models_and_degrees() -> None:
    exp = compose_exp(PAIR, "hardware=local", "backend=real", "real.threads=1")
    prof = full_profile(exp)
    assert covers(prof, ProfileNeeds(models={"smollm2_135m"}, tp={"smollm2_135m": {2}}, threads={1})) == (True, "current")
    ok, why = covers(full_profile(exp, threads=2), ProfileNeeds(threads={1}))
    assert not ok and why == "profile threads 2 != real.threads=1"
    ok, why = covers(prof, ProfileNeeds(models={"llama3_70b"}))
    assert not ok and "llama3_70b" in why
    ok, why = covers(prof, ProfileNeeds(tp={"smollm2_135m": {2, 4}}))
    assert not ok and "TP 4" in why and "TP 2" not in why
    ok, why = covers(prof, ProfileNeeds(threads={1, 2}))
    assert not ok and "separately" in why


def test_what_cannot_be_measured_here_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    needs = ProfileNeeds(tp={"smollm2_135m": {2}})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    line = cannot_measure(needs, "profile has no TP 2 tables of smollm2_135m")
    assert line is not None and "1 core" in line and "+calibrate" in line and "\n" not in line
    assert cannot_measure(ProfileNeeds(), "no profile yet") is None  # TP 1 only: one core will do
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cannot_measure(needs, "profile has no TP 2 tables of smollm2_135m") is None


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_a_sweep_on_one_core_that_needs_tp2_stops_before_any_job(tmp_path: Path) -> None:
    """`taskset -c 0 python -m testbed +sweep=gpu_split hardware=local` (predictions at TP 2)
    with a one-core profile: one line, exit 2, no job started (before: jobs failed one by one)."""
    exp = compose_exp(PAIR, "hardware=local", "backend=real", "real.threads=1")
    prof = tmp_path / "local.json"
    prof.write_text(json.dumps(full_profile(exp, tp=False, cores=1)))
    sweep = tmp_path / "sweep"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    p = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "testbed", "+sweep=gpu_split",
                        "hardware=local", f"sim.profile_path={prof}", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "TP 2" in errors[0] and "1 core" in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not list(sweep.glob("*/summary.json")) and not list(sweep.glob("*/.hydra"))


def _start_sweep(args: list[str]):  # type: ignore[no-untyped-def]
    """The pre-run check, then the sweep's EnsureProfile as Hydra calls it when the multirun starts."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from real.calibrate.ensure_profile import EnsureProfile
    from testbed.paths import CONF_DIR

    preflight(args)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=args, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    EnsureProfile(hardware="local").on_multirun_start(cfg)


@pytest.mark.parametrize("measures_tp", [True, False])
def test_a_profile_short_of_the_jobs_is_measured_for_them_first(tmp_path: Path, monkeypatch, capsys,  # type: ignore[no-untyped-def]
                                                                 measures_tp: bool) -> None:
    """On enough cores, the one-core profile is measured again before any job, for a pair the
    jobs run (not the base config's default pair, which no job of gpu_split runs) at their
    threads; if the new profile still lacks a table a job reads, one line and exit 2."""
    import real.calibrate.profile

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    exp = compose_exp(PAIR, "hardware=local", "backend=real", "real.threads=1")
    prof = tmp_path / "local.json"
    prof.write_text(json.dumps(full_profile(exp, tp=False, cores=1)))
    measured = []

    def fake_calibrate(e, run_dir, **kw):  # type: ignore[no-untyped-def]
        measured.append((e.pair.name, e.real.threads, e.backend))
        prof.write_text(json.dumps(full_profile(e, tp=measures_tp)))
        return prof

    monkeypatch.setattr(real.calibrate.profile, "calibrate", fake_calibrate)
    args = ["+sweep=gpu_split", "hardware=local", f"sim.profile_path={prof}", f"hydra.sweep.dir={tmp_path / 's'}"]
    if measures_tp:
        _start_sweep(args)
        assert measured == [("smollm2_135m+smollm2_draft", 1, "real")]
        assert "no TP 2 tables of smollm2_135m" in capsys.readouterr().out
        _start_sweep(args)  # now current: not measured again
        assert len(measured) == 1
        return
    with pytest.raises(SystemExit) as e:
        _start_sweep(args)
    assert e.value.code == 2 and len(measured) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and "TP 2" in err


@pytest.mark.parametrize("grids", ["[local]", "[base]"])
def test_a_sweep_with_a_local_grid_under_a_published_base_measures_the_profile(
        tmp_path: Path, monkeypatch, grids: str) -> None:  # type: ignore[no-untyped-def]
    """+sweep=load's base config runs on published nodes; its `local` grid runs on this machine
    and reads the latency profile, which is measured first when missing (not for other grids)."""
    import real.calibrate.profile

    prof = tmp_path / "local.json"
    measured = []

    def fake_calibrate(e, run_dir, **kw):  # type: ignore[no-untyped-def]
        measured.append((e.hardware.name, e.pair.name))
        prof.write_text(json.dumps(full_profile(e, tp=False, cores=1)))
        return prof

    monkeypatch.setattr(real.calibrate.profile, "calibrate", fake_calibrate)
    # (the base grid reads no profile: a profile path there is refused as having no effect)
    local = grids == "[local]"
    _start_sweep(["+sweep=load", f"hydra.sweeper.only={grids}", *([f"sim.profile_path={prof}"] if local else []),
                  f"hydra.sweep.dir={tmp_path / 's'}"])
    assert measured == ([("local", "smollm2_135m+smollm2_draft")] if local else [])
