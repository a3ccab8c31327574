"""Requests under load: when each request arrives (``workload.arrival``), and the trace file format.

- ``closed``: ``workload.concurrency`` clients; each sends its first prompt at time 0 and its
  next one the moment its last is answered. One client is the testbed's original setting (one
  request at a time), and serves exactly as it did.
- ``poisson``: the ``workload.num_prompts`` requests arrive with exponential gaps of mean
  1 / ``workload.rate`` seconds, drawn from the run's seed (the same stream on both backends).
- ``trace``: ``workload.trace_path``, a CSV or parquet file with one row per request and the
  columns ``arrival_s`` (seconds from the start, non-negative, non-decreasing),
  ``prompt_tokens`` and ``output_tokens`` (positive integers). The prompt set still gives the
  prompts (cycled in order); the trace sets when they arrive and how many tokens they generate;
  on the simulator also their prompt length.

A run is *under load* (``under_load``) when more than one request can be in flight; its
schedule then serves the active requests in batched rounds (continuous batching) within
``serving.max_batch`` and ``serving.kv_budget_tokens``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

ARRIVALS = ("closed", "poisson", "trace")
TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def under_load(workload) -> bool:  # type: ignore[no-untyped-def]  # testbed.config.WorkloadConfig
    """More than one request can be in flight (batched rounds), else one at a time as always."""
    return workload.arrival != "closed" or workload.concurrency > 1


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests at ``rate`` per second (the first after one gap)."""
    gaps = np.random.default_rng([seed, 0x5EED_A771]).exponential(1.0 / rate, size=n)
    return [float(t) for t in np.cumsum(gaps)]


def read_trace(path: str | Path) -> list[TraceRow]:
    """The rows of a trace file, checked: one ``TraceError`` naming the first bad row. Read once
    per file version (validation, the requests and the arrivals all ask for it)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file (workload.trace_path: a CSV or parquet file)")
    st = p.stat()
    return list(_read_trace(str(p.resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _read_trace(path: str, _mtime_ns: int, _size: int) -> tuple[TraceRow, ...]:
    """read_trace's work, cached by the file's path, modification time and size."""
    p = Path(path)
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # pandas and pyarrow raise many kinds for a damaged file
        raise TraceError(f"{p}: not a readable CSV or parquet file ({str(e).splitlines()[0][:100]})") from None
    missing = [c for c in TRACE_COLUMNS if c not in df.columns]
    if missing:
        raise TraceError(f"{p}: no column {', '.join(missing)} (a trace needs {', '.join(TRACE_COLUMNS)})")
    if df.empty:
        raise TraceError(f"{p}: no rows")
    rows, last = [], 0.0
    for i, r in enumerate(df[list(TRACE_COLUMNS)].itertuples(index=False)):
        where = f"{p}: row {i + 1} ({r.arrival_s}, {r.prompt_tokens}, {r.output_tokens})"
        try:
            t, n_in, n_out = float(r.arrival_s), float(r.prompt_tokens), float(r.output_tokens)
        except (TypeError, ValueError):
            raise TraceError(f"{where}: not numbers") from None
        if not np.isfinite(t) or t < 0:
            raise TraceError(f"{where}: arrival_s must be a time >= 0 in seconds")
        if t < last:
            raise TraceError(f"{where}: arrives before the row above ({last}); sort the trace by arrival_s")
        for name, v in (("prompt_tokens", n_in), ("output_tokens", n_out)):
            if not (np.isfinite(v) and v >= 1 and v == int(v)):
                raise TraceError(f"{where}: {name} must be a whole number >= 1")
        rows.append(TraceRow(t, int(n_in), int(n_out)))
        last = t
    return tuple(rows)


def arrival_times(exp, n: int) -> list[float] | None:  # type: ignore[no-untyped-def]  # ExperimentConfig
    """Each of ``n`` requests' arrival after the run's start, the same on both backends (poisson:
    from the run's seed; trace: its rows), None for a closed loop."""
    w = exp.workload
    if w.arrival == "poisson":
        return poisson_times(n, w.rate, exp.seed)
    if w.arrival == "trace":
        return [row.arrival_s for row in read_trace(w.trace_path)][:n]
    return None
