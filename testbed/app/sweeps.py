"""What a multirun adds to a run: resume, failures, progress, one results table, one host lock.

State lives in the sweep directory, not in memory, so it works the same whatever Hydra launcher
runs the jobs (basic: one process; joblib: worker processes; submitit: other machines):

- a job's directory gets ``experiment_hash`` after its results; a re-run of the sweep into the
  same ``hydra.sweep.dir`` skips a job whose ``summary.json`` exists and whose stored hash
  equals the hash of the job's resolved experiment, and redoes the rest;
- a failing job writes ``job_failed.json`` (the error, one line, and the traceback when it is not
  a user error) instead of ending the sweep; the sweep report lists it;
- ``.sweep.json`` (written when the multirun starts) holds the start time and the job count for
  the progress line printed to stderr after every job (done, failed, skipped, ETA); each job of
  this attempt marks its directory ``.finished`` (and ``.skipped`` when it was already done), so
  the line counts this attempt's jobs, not the summaries an earlier attempt left;
- ``results.parquet`` and ``results.csv``: every summary (and every failure) of the sweep.

`backend=real` jobs hold a host-wide lock while they run (two real runs on one machine distort
each other's timings) unless ``real.allow_concurrent=true``; the ranks of one torchrun job share
it (testbed.app.host_lock).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testbed.app.unused_settings import HASH_FILE, experiment_hash
from testbed.config import ExperimentConfig

FAILED = "job_failed.json"
SKIPPED, FINISHED = ".skipped", ".finished"  # this attempt's markers (cleared by start)
STATE = ".sweep.json"
PROGRESS_LOCK, PROGRESS_LAST = ".progress.lock", ".progress"  # job_finished


_CHECKED: dict[str, list[ExperimentConfig]] = {}  # sweep key -> its jobs, as the pre-run check saw them


def sweep_key(cfg: Any) -> str:
    """``hydra.sweep.dir`` as written, before interpolation: the same in the pre-run check's
    composition and in Hydra's, though a default ``${now:...}`` may resolve a second apart."""
    from omegaconf import OmegaConf

    return str(OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["dir"])


def remember_jobs(cfg: Any, exps: list[ExperimentConfig]) -> None:
    """The pre-run check's experiments of every job (testbed.app.preflight), for callbacks that
    prepare the sweep in this process before any job runs (real.calibrate.ensure_profile)."""
    _CHECKED.clear()
    _CHECKED[sweep_key(cfg)] = exps


def checked_jobs(cfg: Any) -> list[ExperimentConfig] | None:
    """The jobs of the sweep ``cfg`` starts, as checked before it started (None: not here)."""
    return _CHECKED.get(sweep_key(cfg))


def already_done(run_dir: Path, exp: ExperimentConfig) -> bool:
    h = run_dir / HASH_FILE
    return ((run_dir / "summary.json").exists() and h.exists()
            and h.read_text().strip() == experiment_hash(exp))


def store_hash(run_dir: Path, exp: ExperimentConfig) -> None:
    tmp = run_dir / f".{HASH_FILE}.tmp"
    tmp.write_text(experiment_hash(exp) + "\n")
    tmp.replace(run_dir / HASH_FILE)
    (run_dir / FAILED).unlink(missing_ok=True)


def job_failed(run_dir: Path, e: BaseException, user_error: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    info = {"error": line, "type": type(e).__name__,
            "traceback": None if user_error else traceback.format_exc()}
    (run_dir / FAILED).write_text(json.dumps(info, indent=2) + "\n")
    print(f"error: job {run_dir.name}: {line}", file=sys.stderr)
    job_finished(run_dir)


def _state(sweep_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((sweep_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}


def start(sweep_dir: Path, jobs: int) -> None:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    for d in sweep_dir.iterdir():  # markers of an earlier attempt
        if d.is_dir():
            (d / SKIPPED).unlink(missing_ok=True)
            (d / FINISHED).unlink(missing_ok=True)
    (sweep_dir / PROGRESS_LAST).unlink(missing_ok=True)
    (sweep_dir / STATE).write_text(json.dumps({"start": time.time(), "jobs": jobs}) + "\n")


def job_dirs(sweep_dir: Path) -> list[Path]:
    return [d for d in sweep_dir.iterdir() if d.is_dir() and (d / ".hydra").exists()]


def counts(sweep_dir: Path) -> dict[str, int]:
    """This attempt's jobs: done (skipped ones included), failed, skipped."""
    dirs = [d for d in job_dirs(sweep_dir) if (d / FINISHED).exists()]
    failed = sum((d / FAILED).exists() for d in dirs)
    skipped = sum((d / SKIPPED).exists() for d in dirs)
    return {"done": len(dirs) - failed, "failed": failed, "skipped": skipped}


def progress_line(sweep_dir: Path, c: dict[str, int] | None = None) -> str:
    st, c = _state(sweep_dir), c or counts(sweep_dir)
    total = int(st.get("jobs") or 0)
    finished = c["done"] + c["failed"]
    ran = finished - c["skipped"]
    elapsed = time.time() - float(st.get("start", time.time()))
    line = f"sweep: {finished}/{total or '?'} jobs done"
    if c["failed"]:
        line += f", {c['failed']} failed"
    if c["skipped"]:
        line += f", {c['skipped']} skipped (finished before)"
    if total and ran > 0 and finished < total:
        line += f", ETA {elapsed / ran * (total - finished):.0f} s"
    return line + f" ({elapsed:.0f} s)"


def job_finished(run_dir: Path, skipped: bool = False) -> None:
    """Print the sweep's progress line. Under the joblib launcher several workers finish jobs at
    once: the lock makes each count-and-print one step, so the counts printed only increase (a
    job finishing while another counts is announced by the next line), and each line goes out in
    one write, so lines never interleave on a shared stderr."""
    from filelock import FileLock

    if skipped:
        (run_dir / SKIPPED).touch()
    (run_dir / FINISHED).touch()
    sweep_dir = run_dir.parent
    with FileLock(str(sweep_dir / PROGRESS_LOCK)):
        c = counts(sweep_dir)
        finished_now = c["done"] + c["failed"]
        last = sweep_dir / PROGRESS_LAST
        try:
            shown = int(last.read_text())
        except (OSError, ValueError):
            shown = -1
        if finished_now > shown:
            last.write_text(str(finished_now))
            _write_line(progress_line(sweep_dir, c))


def _write_line(line: str) -> None:
    """One write(2) of the whole line where stderr is a file (atomic below PIPE_BUF)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # (a captured stderr: pytest's capsys)
        print(line, file=sys.stderr, flush=True)
        return
    os.write(fd, (line + "\n").encode())


@contextlib.contextmanager
def real_run_lock(exp: ExperimentConfig, run_dir: Path) -> Iterator[None]:
    """One real job at a time on this host (unless real.allow_concurrent=true); the ranks of one
    torchrun job share it (testbed.app.host_lock)."""
    if exp.backend != "real" or exp.real.allow_concurrent:
        yield
        return
    from testbed.app import host_lock

    with host_lock.held(run_dir.name):
        yield


def failures(sweep_dir: Path) -> list[dict[str, Any]]:
    out = []
    for d in sorted(job_dirs(sweep_dir), key=lambda p: (len(p.name), p.name)):
        f = d / FAILED
        if f.exists():
            try:
                info = json.loads(f.read_text())
            except ValueError:
                info = {"error": "unreadable job_failed.json"}
            overrides = d / ".hydra" / "overrides.yaml"
            info["job"] = d.name
            info["overrides"] = " ".join(
                ln.removeprefix("- ").strip() for ln in overrides.read_text().splitlines()
                if ln.strip()) if overrides.exists() else ""
            out.append(info)
    return out


def write_results(sweep_dir: Path) -> Path | None:
    """results.parquet + results.csv: one row per job (summary, or the failure)."""
    import pandas as pd

    from testbed.results import find_runs, summaries_frame, write_parquet

    runs = [r for r in find_runs([sweep_dir]) if not (r.path / FAILED).exists()]
    df = summaries_frame(runs) if runs else pd.DataFrame()
    if len(df):
        df["status"] = "ok"
        df["job"] = [Path(p).name for p in df["run_dir"]]
    fails = pd.DataFrame([{"job": f["job"], "status": "failed", "error": f["error"],
                           "overrides": f["overrides"]} for f in failures(sweep_dir)])
    df = pd.concat([df, fails], ignore_index=True) if len(fails) else df
    if df.empty:
        return None
    df = df.sort_values("job", key=lambda s: s.map(lambda j: (len(str(j)), str(j)))).reset_index(drop=True)
    df["run_dir"] = df.get("run_dir", pd.Series(dtype=str)).map(
        lambda p: os.path.relpath(p, sweep_dir) if isinstance(p, str) else None)
    write_parquet(sweep_dir / "results.parquet", df)
    tmp = sweep_dir / ".results.csv.tmp"
    df.to_csv(tmp, index=False)
    tmp.replace(sweep_dir / "results.csv")
    return sweep_dir / "results.parquet"
