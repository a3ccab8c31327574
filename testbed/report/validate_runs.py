"""Which runs a validation compares: the join key of a predicted and a measured run, a real
run's split, its schedule family, and each measured run's trace-source run (shared by the
validation sections and the sampling-size advice)."""

from __future__ import annotations

import pandas as pd

from testbed.metrics import KEY_FIELDS
from testbed.report.schedule_kinds import without_draft
from testbed.results import Run
from testbed.results import run_split as split_of
from testbed.workloads import TRACE_SOURCE, TRACE_SPLITS

JOIN = tuple(k for k in KEY_FIELDS if k != "backend") + ("split",)


def run_split(run: Run) -> str:
    return split_of(run.path, run.summary)


def family(summary: dict) -> str:
    """The schedule family a run belongs to: `sync` (chain), `sync_tree` (serial tree),
    `async`, `decentralized`, `ar` — with its lookahead policy when that is not static, and
    "under load" for a run of many requests in flight."""
    name = str(summary.get("schedule"))
    policy = summary.get("lookahead")
    out = f"{name}+{policy}" if policy and policy != "static" and name not in without_draft() else name
    return f"{out} under load" if summary.get("arrival") else out  # testbed/arrivals.py


def measured_with_source(runs: list[Run], val: pd.DataFrame, schedules: tuple[str, ...] | None = None
                         ) -> list[tuple[Run, Run, dict]]:
    """(measured real run, its trace-source real run, its join key) for every real run of
    ``val``'s measurements (of ``schedules``, or every one but `ar`) whose trace-source run —
    the same configuration on the split that fed its prediction — is among ``runs``."""
    def key(run: Run) -> tuple:
        s = run.summary
        return tuple(float(s.get(k)) if k == "temperature" else s.get(k) for k in JOIN if k != "split")

    real = [r for r in runs if r.summary.get("backend") == "real"
            and (r.summary.get("schedule") in schedules if schedules
                 else r.summary.get("schedule") not in without_draft())]
    sources = {(key(r), run_split(r)): r for r in real if run_split(r) in TRACE_SPLITS}
    measured = {tuple(r[k] for k in JOIN) for _, r in val.iterrows()} if len(val) else set()
    out = []
    for run in real:
        split = run_split(run)
        src = sources.get((key(run), TRACE_SOURCE.get(split, "")))
        if src is not None and (*key(run), split) in measured:
            out.append((run, src, dict(zip(JOIN, (*key(run), split)))))
    return out
