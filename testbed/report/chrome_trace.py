"""A run's timeline as Chrome trace JSON (the Trace Event Format), for Perfetto and chrome://tracing.

    python -m testbed.report.chrome_trace RUN_OR_SWEEP_DIR... [--out FILE]

Every run directory of either backend holds ``timeline.parquet``: one row per span of work on a
resource (a device group such as ``target`` or ``draft``, a pipeline stage, a link ``link u->v``)
with its kind (prefill, draft, expand, verify, link), start and end on the run's clock, request
and round. Each span becomes a complete event (``"ph": "X"``, microseconds); each resource is
one track, the device groups and stages in one process and the links in another, so a user sees
the rounds overlap (async), the windows flow through the stages (decentralized) and the messages
in flight without code. A verification span carries its round's drafted, accepted and emitted
counts (rounds.parquet) as arguments; under load the target's forwards also draw a counter
track of the batch size (``"ph": "C"``: requests per forward over time). Writes ``trace.json`` into each run directory (``--out``:
one file, for a single run), atomically; prints the paths.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.results import Run, RunDirError, find_runs, write_json

DEVICES_PID, LINKS_PID = 1, 2
ROUND_ARGS = ("drafted", "accepted", "emitted", "verified_tokens")


def _round_args(rounds: pd.DataFrame) -> dict[tuple[int, int], dict[str, int]]:
    if rounds.empty:
        return {}
    cols = [c for c in ROUND_ARGS if c in rounds.columns]
    return {(int(r.request_id), int(r.round)): {c: int(getattr(r, c)) for c in cols}
            for r in rounds.itertuples(index=False)}


def trace_events(timeline: pd.DataFrame, rounds: pd.DataFrame, *, label: str) -> dict[str, Any]:
    """The Trace Event Format object of one run: metadata naming the processes and tracks, then
    one complete event per timeline span, in start order."""
    # the target's track first, then the draft's and the stages', then the links
    resources = sorted(timeline["resource"].unique(),
                       key=lambda r: (str(r).startswith("link"), str(r) != "target", str(r))) \
        if not timeline.empty else []
    tid = {r: i + 1 for i, r in enumerate(resources)}
    pid = {r: LINKS_PID if str(r).startswith("link") else DEVICES_PID for r in resources}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": DEVICES_PID, "args": {"name": f"{label}: devices"}},
        {"ph": "M", "name": "process_name", "pid": LINKS_PID, "args": {"name": f"{label}: links"}},
    ]
    for r in resources:
        events.append({"ph": "M", "name": "thread_name", "pid": pid[r], "tid": tid[r], "args": {"name": str(r)}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid[r], "tid": tid[r],
                       "args": {"sort_index": tid[r]}})
    per_round = _round_args(rounds)
    for s in timeline.sort_values("start_s", kind="stable").itertuples(index=False):
        if not (math.isfinite(s.start_s) and math.isfinite(s.end_s)):
            continue
        args: dict[str, Any] = {}
        if s.request_id >= 0:
            args["request"] = int(s.request_id)
        if s.round >= 0:
            args["round"] = int(s.round)
            if s.kind == "verify":
                args.update(per_round.get((int(s.request_id), int(s.round)), {}))
        events.append({"ph": "X", "name": str(s.kind), "cat": str(s.kind), "pid": pid[s.resource],
                       "tid": tid[s.resource], "ts": round(s.start_s * 1e6, 3),
                       "dur": round(max(0.0, s.end_s - s.start_s) * 1e6, 3), "args": args})
        if "batch" in s._fields and s.batch > 1 and s.resource == "target":
            events.append({"ph": "C", "name": "batch", "pid": DEVICES_PID, "ts": round(s.start_s * 1e6, 3),
                           "args": {"requests": int(s.batch)}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run": label}}


def run_label(run: Run) -> str:
    s = run.summary
    return f"{s.get('backend', '?')} {s.get('schedule', '?')}"


def export(run: Run, out: Path | None = None) -> Path:
    path = out or run.path / "trace.json"
    trace = trace_events(run.frame("timeline"), run.frame("rounds"), label=run_label(run))
    write_json(path, trace)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.report.chrome_trace",
                                 description="Write each run's timeline as Chrome trace JSON (trace.json), "
                                             "for https://ui.perfetto.dev or chrome://tracing.")
    ap.add_argument("dirs", nargs="+", type=Path, help="run directories or sweep directories")
    ap.add_argument("--out", type=Path, default=None, help="the file to write (only for a single run)")
    args = ap.parse_args(argv)
    try:
        runs = find_runs(args.dirs)
        if not runs:
            raise FileNotFoundError(f"{', '.join(map(str, args.dirs))}: no complete run (a directory "
                                    "with summary.json) here; give a run or sweep directory")
        if args.out is not None and len(runs) != 1:
            raise ValueError(f"--out names one file, but {len(runs)} runs were found; leave --out out "
                             "to write trace.json into each run directory")
        for run in runs:
            print(export(run, args.out))
    except (FileNotFoundError, RunDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
