"""Sweeps: an interrupted sweep re-run into the same directory redoes only the unfinished jobs
and ends with the results of an uninterrupted one; a failing job is reported, not fatal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from testbed.results import write_run
from tests.conftest import ROOT, compose_exp, run_cli

GRID = ["-m", "schedule.gamma=1,2,3,4,5,6", "acceptance.alpha=0.6,0.8", "workload.num_prompts=2",
        "workload.max_new_tokens=64"]
JOBS = 12


def finished(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/summary.json"))


def test_interrupted_sweep_resumes_where_it_stopped(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "testbed", *GRID, f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while len(finished(sweep)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # as a crash or Ctrl-C would leave it
    proc.wait(timeout=30)
    done_before = finished(sweep)
    assert 3 <= len(done_before) < JOBS, "the sweep was not interrupted midway"
    stamps = {d: ((d / "summary.json").stat().st_mtime_ns, (d / "run_info.json").read_text())
              for d in done_before}

    p = run_cli(*GRID, f"hydra.sweep.dir={sweep}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"{len(done_before)} skipped" in p.stderr
    assert len(finished(sweep)) == JOBS
    for d, stamp in stamps.items():  # finished jobs were not run again
        assert ((d / "summary.json").stat().st_mtime_ns, (d / "run_info.json").read_text()) == stamp

    clean = tmp_path / "clean"
    q = run_cli(*GRID, f"hydra.sweep.dir={clean}")
    assert q.returncode == 0, q.stderr[-2000:]
    resumed, whole = pd.read_parquet(sweep / "results.parquet"), pd.read_parquet(clean / "results.parquet")
    assert len(whole) == JOBS and set(whole["status"]) == {"ok"}
    pd.testing.assert_frame_equal(resumed, whole)
    assert (sweep / "results.csv").read_text() == (clean / "results.csv").read_text()


# 0 removed (every job skipped) is slow: by default test_interrupted_sweep_resumes_where_it_stopped
# and the README's `+sweep=wan hydra.sweep.dir=DIR` run (twice: "2 skipped") count skipped jobs
@pytest.mark.parametrize("removed", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_resume_counts_every_skipped_job(tmp_path: Path, removed: int) -> None:
    """A re-run into the same hydra.sweep.dir, with the results of ``removed`` of its n jobs
    deleted, prints one progress line per job and ends with n/n done, n - removed skipped (not
    the summaries an earlier attempt left counted as done at the first skip)."""
    sweep, n = tmp_path / "sweep", 4
    args = ["-m", "schedule.gamma=1,2,3,4", "workload.num_prompts=1", "workload.max_new_tokens=8",
            "report.per_run=false", f"hydra.sweep.dir={sweep}"]
    assert run_cli(*args).returncode == 0
    for d in sorted(finished(sweep))[:removed]:
        (d / "summary.json").unlink()
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("sweep: ")]
    assert [ln.split()[1] for ln in lines] == [f"{i}/{n}" for i in range(1, n + 1)], lines
    assert f"{n - removed} skipped" in lines[-1], lines[-1]
    assert len(finished(sweep)) == n


def test_changed_experiment_is_rerun(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    base = ["-m", "schedule.gamma=1,2", "workload.num_prompts=1", "workload.max_new_tokens=16",
            f"hydra.sweep.dir={sweep}"]
    assert run_cli(*base).returncode == 0
    p = run_cli(*base, "workload.max_new_tokens=24")  # same job numbers, other experiments
    assert p.returncode == 0 and "skipped" not in p.stderr
    df = pd.read_parquet(sweep / "results.parquet")
    assert (df["generated_tokens"] == 24).all()


def test_failing_job_is_reported_and_others_kept(tmp_path: Path) -> None:
    trace = tmp_path / "trace_run"
    exp = compose_exp("workload.num_prompts=1", "workload.max_new_tokens=16")
    from sim.runtime.engine import run

    write_run(trace, exp, run(exp))
    bad = tmp_path / "bad_trace"
    write_run(bad, exp, run(exp))
    (bad / "rounds.parquet").write_bytes(b"not parquet")
    sweep = tmp_path / "sweep"
    p = run_cli("-m", "acceptance=trace", f"acceptance.trace_path={trace},{bad}",
                "workload.num_prompts=1", "workload.max_new_tokens=16", f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr and "1 job(s) failed" in p.stderr
    df = pd.read_parquet(sweep / "results.parquet")
    assert list(df["status"]) == ["ok", "failed"]
    assert "rounds.parquet" in df["error"].iloc[1]
    report = (sweep / "report.md").read_text()
    assert "## Failed jobs" in report and "rounds.parquet" in report
    assert (sweep / "0" / "summary.json").exists()


HOLDER = """
import sys
from pathlib import Path
import testbed.app.host_lock as h
h.REAL_LOCK = Path(sys.argv[1]); h.STATE = h.REAL_LOCK.with_suffix(".json")
assert h.try_enter(sys.argv[2])
print("in", flush=True)
sys.stdin.read()
"""


def _holder(lock: Path, key: str) -> subprocess.Popen:
    """Another process that holds the host lock under ``key`` until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), key], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "in"
    return p


def test_real_runs_take_turns_on_one_host(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A real job waits while another holds the host lock, unless real.allow_concurrent=true;
    a holder that died no longer holds it."""
    import threading

    from testbed.app import host_lock
    from testbed.app.sweeps import real_run_lock

    monkeypatch.setattr(host_lock, "REAL_LOCK", tmp_path / "real.lock")
    monkeypatch.setattr(host_lock, "STATE", tmp_path / "real.json")
    exp = compose_exp("backend=real", "real.progress=false")
    entered = threading.Event()

    def job() -> None:
        with real_run_lock(exp, tmp_path):
            entered.set()

    other = _holder(tmp_path / "real.lock", "process elsewhere")
    try:
        t = threading.Thread(target=job)
        t.start()
        assert not entered.wait(1.0), "a second real run started while the first held the host"
        exp.real.allow_concurrent = True
        with real_run_lock(exp, tmp_path):
            pass  # allowed at once
    finally:
        other.kill()  # as a crash would: the lock is not released, its holder is gone
        other.wait(timeout=30)
    t.join(timeout=30)
    assert entered.is_set() and not t.is_alive()
    assert host_lock.holder_key() is None


def test_ranks_of_one_torchrun_job_share_the_host_lock(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every rank of a torchrun job runs the app and takes the lock: the ranks of one job enter
    together (else they wait on each other until the rendezvous times out), another job waits."""
    from testbed.app import host_lock

    monkeypatch.setattr(host_lock, "REAL_LOCK", tmp_path / "real.lock")
    monkeypatch.setattr(host_lock, "STATE", tmp_path / "real.json")
    job = {"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "WORLD_SIZE": "2"}
    rank0 = host_lock.job_key({**job, "RANK": "0", "LOCAL_RANK": "0"})
    rank1 = host_lock.job_key({**job, "RANK": "1", "LOCAL_RANK": "1"})
    node1 = host_lock.job_key({**job, "RANK": "1", "LOCAL_RANK": "0"})  # --nnodes 2 on one host
    other_job = host_lock.job_key({**job, "MASTER_PORT": "29501", "RANK": "0", "LOCAL_RANK": "0"})
    assert rank0 == rank1 == node1 != other_job
    assert host_lock.job_key({}, pid=1) != host_lock.job_key({}, pid=2)
    holder = _holder(tmp_path / "real.lock", rank0)
    try:
        assert host_lock.try_enter(rank1)  # the other rank of the same job: at once
        assert not host_lock.try_enter(other_job)
        host_lock.leave()
        assert host_lock.holder_key() == rank0  # rank 0 still runs
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        holder.wait(timeout=30)
    assert host_lock.try_enter(other_job)
    host_lock.leave()


def _finish_jobs(sweep: str, names: list[str], barrier: object, err_path: str) -> None:
    """In a child process: mark jobs done at the same moment as the others, then announce."""
    from testbed.app import sweeps

    sys.stderr = open(err_path, "a")  # noqa: SIM115  (the child's stderr until it exits)
    for name in names:
        barrier.wait()  # type: ignore[attr-defined]
        (Path(sweep) / name / "summary.json").write_text("{}")
        sweeps.job_finished(Path(sweep) / name)


def test_progress_lines_from_parallel_workers_only_count_up(tmp_path: Path) -> None:
    """Workers finishing jobs at once (the joblib launcher) print whole lines whose counts only
    increase and end at the total, not the same count twice or two lines run together."""
    import multiprocessing as mp

    from testbed.app import sweeps

    sweep, workers, per_worker = tmp_path / "sweep", 4, 6
    sweep.mkdir()
    sweeps.start(sweep, workers * per_worker)
    names = [str(i) for i in range(workers * per_worker)]
    for n in names:
        (sweep / n / ".hydra").mkdir(parents=True)
    err = tmp_path / "stderr"
    err.touch()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_finish_jobs, args=(str(sweep), names[w::workers], barrier, str(err)))
             for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    lines = err.read_text().splitlines()
    assert lines and all(ln.startswith("sweep: ") and ln.count("sweep:") == 1 for ln in lines)
    shown = [int(ln.split()[1].split("/")[0]) for ln in lines]
    assert shown == sorted(set(shown)), shown  # strictly increasing
    assert shown[-1] == workers * per_worker
