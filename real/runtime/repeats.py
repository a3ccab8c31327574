"""``real.repeats=N``: measure the run's configuration and its `ar` baseline N times each,
interleaved (testbed/repeats.py), and record the machine's state around every measurement.

Machine state: load average (1 min), CPU clock where readable (psutil), and a short
memory-bandwidth probe (the best of three sums over 64 MB, ~20 ms: decode is bound by it). A
measurement is flagged when the machine changed under it: load average moved by more than
LOAD_DELTA, or the bandwidth or the clock by more than REL_DELTA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from testbed.recorder import RunRecorder
from testbed.repeats import BASELINE, interleaved_order, repeat_summary

LOAD_DELTA, REL_DELTA = 1.0, 0.15
PROBE_FLOATS = 16 << 20  # 64 MB of float32


def bandwidth_gbps(buffer: torch.Tensor) -> float:
    """Read bandwidth of one pass over `buffer` (best of three)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def machine_state(buffer: torch.Tensor | None = None) -> dict[str, float | None]:
    freq = None
    try:
        f = psutil.cpu_freq()
        freq = float(f.current) if f and f.current else None
    except (OSError, NotImplementedError, AttributeError):  # not readable in every VM
        freq = None
    return {"time": time.time(), "load1": os.getloadavg()[0], "cpu_mhz": freq,
            "bandwidth_gbps": bandwidth_gbps(buffer) if buffer is not None else None}


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What moved between two machine states beyond the thresholds."""
    out = []
    if abs(after["load1"] - before["load1"]) > LOAD_DELTA:
        out.append(f"load {before['load1']:.1f}->{after['load1']:.1f}")
    for key in ("cpu_mhz", "bandwidth_gbps"):
        a, b = before.get(key), after.get(key)
        if a and b and abs(b / a - 1) > REL_DELTA:
            out.append(f"{key} {a:.1f}->{b:.1f}")
    return out


def _measured(buffer: torch.Tensor | None, config: str, repeat: int, fn: Callable[[], Any]
              ) -> tuple[Any, dict[str, Any]]:
    """``fn()`` and the machine's state around it."""
    before = machine_state(buffer)
    out = fn()
    after = machine_state(buffer)
    return out, {"config": config, "repeat": repeat, "before": before, "after": after,
                 "changed": changed(before, after)}


def _order_fields(order: list[str], states: list[dict[str, Any]]) -> dict[str, Any]:
    return {"measure_order": order, "machine_states": states,
            "machine_changed": [f"{s['config']}#{s['repeat']}: " + ", ".join(s["changed"])
                                for s in states if s["changed"]]}


def serve_interleaved(impl: str, repeats: int, *, baseline: bool,
                      measure: Callable[[str, dict | None], RunRecorder],
                      schedule_extra: dict, seed: int = 0, probe: bool = True
                      ) -> tuple[RunRecorder, RunRecorder | None, dict[str, Any]]:
    """Measure `impl` (and `ar` when `baseline`) `repeats` times, interleaved. ``measure(name,
    extra)`` serves the prompts once with schedule `name`. Returns the first pass's recorders
    (the run's files) and the summary fields over every pass."""
    order = interleaved_order([impl], repeats, BASELINE if baseline else None)
    buffer = torch.ones(PROBE_FLOATS) if probe else None
    recs: dict[str, list[RunRecorder]] = {}
    states = []
    for name, r in order:
        extra = schedule_extra if (name != BASELINE and r == 0) else None
        rec, state = _measured(buffer, name, r, lambda name=name, extra=extra: measure(name, extra))
        recs.setdefault(name, []).append(rec)
        states.append(state)
    fields = repeat_summary({n: [x.requests for x in rs] for n, rs in recs.items()}, impl,
                            BASELINE if baseline else None, seed=seed)
    fields.update(_order_fields([f"{n}#{r}" for n, r in order], states))
    base = recs.get(BASELINE, [None])[0] if baseline else None
    return recs[impl][0], base, fields


def run_repeated(exp: Any, run_once: Callable[[Any], Any], impl: str, probe: bool = True) -> Any:
    """``real.repeats=N`` for runs that launch their own worker processes (`async`, DSD's
    pipeline): the whole run — the schedule, then its `ar` baseline — N times, so the passes
    measure A ar A ar … (interleaved, as serve_interleaved). Returns the first pass's result
    (the run's files) with the summary fields over every pass."""
    import copy

    once = copy.deepcopy(exp)
    once.real.repeats = 1
    buffer = torch.ones(PROBE_FLOATS) if probe else None
    results, states = [], []
    for r in range(exp.real.repeats):
        res, state = _measured(buffer, impl, r, lambda: run_once(once))
        if not res.extra.get("writer", True):  # torchrun, not rank 0: nothing to summarize
            return res
        if res.baseline is not None:
            state["config"] = f"{impl}+{BASELINE}"
        results.append(res)
        states.append(state)
    baseline = all(res.baseline is not None for res in results)
    measured = {impl: [res.recorder.requests for res in results]}
    if baseline:
        measured[BASELINE] = [res.baseline.requests for res in results]
    fields = repeat_summary(measured, impl, BASELINE if baseline else None, seed=exp.seed)
    names = [impl, BASELINE] if baseline else [impl]
    fields.update(_order_fields([f"{n}#{r}" for r in range(len(results)) for n in names], states))
    results[0].extra.update(fields)
    return results[0]
