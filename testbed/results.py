"""Writing and reading run directories.

A run directory holds summary.json, rounds.parquet, requests.parquet, timeline.parquet,
config.yaml (the resolved experiment) and, when the report is built, report.md and figures.
Files are written to temporaries and renamed, and summary.json goes last: a directory with a
summary.json is a complete run; anything else is ignored by readers.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from testbed.arrivals import under_load
from testbed.config import ExperimentConfig, as_dict
from testbed.metrics import experiment_key, load_metrics, summarize, tree_shape
from testbed.recorder import RunResult
from testbed.schedules import spec_of

SUMMARY = "summary.json"
# run fields too big for a summary row (results.parquet has one per run): their own files
SIDE_FILES = {"draft_rows": "draft_rows.json"}  # testbed.spec.tree_drafter.DraftRowSample


class RunDirError(ValueError):
    """A run directory's file cannot be read (corrupt or truncated); names the file."""


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    def w(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, allow_nan=False)
            f.write("\n")
    _atomic_write(path, w)


def write_parquet(path: Path, df: pd.DataFrame) -> None:
    _atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def build_summary(exp: ExperimentConfig, result: RunResult) -> dict[str, Any]:
    rounds, requests, timeline = result.recorder.frames()
    base = result.baseline.frames()[1] if result.baseline is not None else None
    if not spec_of(exp).drafts:  # the baseline itself
        base = requests
    summary = experiment_key(exp)
    summary.update(summarize(rounds, requests, exp.schedule.gamma, base))
    if under_load(exp.workload):  # testbed/arrivals.py: latency percentiles, goodput, batch
        w = exp.workload
        summary.update({"arrival": w.arrival, "concurrency": w.concurrency if w.arrival == "closed" else None,
                        "rate": w.rate if w.arrival == "poisson" else None})
        summary.update(load_metrics(requests, timeline, slo_ttft_ms=exp.serving.slo_ttft_ms,
                                    slo_tpot_ms=exp.serving.slo_tpot_ms, baseline_requests=base))
    summary.update({k: v for k, v in result.extra.items() if k not in SIDE_FILES})
    summary["tree_shape"] = tree_shape(summary)
    return summary


def write_run(run_dir: Path, exp: ExperimentConfig, result: RunResult) -> dict[str, Any]:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stale = run_dir / SUMMARY
    if stale.exists():  # re-running into the same directory: invalidate first
        stale.unlink()
    rounds, requests, timeline = result.recorder.frames()
    summary = build_summary(exp, result)
    write_parquet(run_dir / "rounds.parquet", rounds)
    write_parquet(run_dir / "requests.parquet", requests)
    write_parquet(run_dir / "timeline.parquet", timeline)
    if result.baseline is not None:
        b_rounds, b_requests, _ = result.baseline.frames()
        write_parquet(run_dir / "baseline_requests.parquet", b_requests)
    side = {SIDE_FILES[k]: {k: v} for k, v in result.extra.items() if k in SIDE_FILES}
    for name, obj in {**side, **result.artifacts}.items():
        if isinstance(obj, pd.DataFrame):
            write_parquet(run_dir / name, obj)
        else:
            write_json(run_dir / name, obj)
    _atomic_write(run_dir / "experiment.yaml",
                  lambda tmp: Path(tmp).write_text(yaml.safe_dump(as_dict(exp), sort_keys=False)))
    write_json(run_dir / SUMMARY, summary)
    return summary


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]

    def frame(self, name: str) -> pd.DataFrame:
        p = self.path / f"{name}.parquet"
        if not p.exists():
            return pd.DataFrame()
        try:
            return pd.read_parquet(p)
        except Exception as e:  # pyarrow raises several kinds for a damaged file
            raise RunDirError(f"{p}: not a readable parquet file ({str(e).splitlines()[0][:120]}); "
                              "delete the run directory or re-run it") from None


def find_runs(paths: Iterable[Path | str]) -> list[Run]:
    """Every complete run at or below the given paths, sorted by path."""
    runs: list[Run] = []
    seen: set[Path] = set()
    for p in map(Path, paths):
        if not p.is_dir():
            raise FileNotFoundError(f"{p}: no such run or sweep directory")
        candidates = [p / SUMMARY] if (p / SUMMARY).exists() else sorted(p.rglob(SUMMARY))
        for s in candidates:
            d = s.parent.resolve()
            if d in seen:
                continue
            seen.add(d)
            try:
                summary = json.loads(s.read_text())
                if not isinstance(summary, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, UnicodeDecodeError) as e:
                raise RunDirError(f"{s}: not a readable summary ({e}); delete the run directory "
                                  "or re-run it") from None
            runs.append(Run(path=s.parent, summary=summary))
    runs.sort(key=lambda r: _natural_key(str(r.path)))
    return runs


def _natural_key(s: str) -> list[object]:
    """Sort sweep job directories 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def summaries_frame(runs: list[Run]) -> pd.DataFrame:
    rows = [{**r.summary, "run_dir": str(r.path)} for r in runs]
    return pd.DataFrame(rows)


def run_split(run_dir: Path, summary: dict) -> str:
    """The prompt split a run used (experiment.yaml, else summary's workload_split, else all)."""
    exp_file = run_dir / "experiment.yaml"
    if exp_file.exists():
        split = (yaml.safe_load(exp_file.read_text()) or {}).get("workload", {}).get("split")
        if split:
            return str(split)
    return str(summary.get("workload_split") or "all")
