"""Prediction intervals for trace-replay predictions (``sim.prediction_resamples=B``).

A prediction with ``acceptance=trace`` replays the acceptance of a few recorded prompts; had
other prompts been recorded it would differ. The interval resamples what the prediction rests
on: the trace's requests (prompts) with replacement, and within each drawn request its rounds
(drafted, accepted) with replacement — a two-stage bootstrap like testbed/stats.py's over
measured values — and simulates the experiment again on each of the B resampled traces (same
seed, same prompts, same cost model). The percentile interval of the B predictions is the 95%
prediction interval, reported beside the point prediction as ``<metric>_pi95``; the `ar`
baseline replays no acceptance, so it is not resampled (speedup's interval is tokens/s's over it).

Speed: B simulations cost B times one. A token-tree prediction with the n-gram draft (deep trees,
~10^3 expansions per request) took ~0.6 s each, 2-3 min for B = 200, while the rest of the
machine idled (a validate sweep runs its jobs one at a time). When the first resample shows that
the rest would take longer than ``PARALLEL_FROM_S``, they are simulated on every core of this
process (joblib's loky pool; never from inside a worker of a parallel sweep, where the cores are
already busy). The resampled traces are drawn up front in the same order as sequentially, so the
interval is identical either way.
"""

from __future__ import annotations

import random
from typing import Any

from sim.oracle.trace import RequestTrace, TraceOracle, load_trace
from testbed.config import ExperimentConfig
from testbed.metrics import summarize
from testbed.stats import percentile_interval

METRICS = ("tokens_per_s", "tpot_ms", "speedup", "mean_accepted_len")


class ResampledTraceOracle(TraceOracle):
    """The trace oracle over given (resampled) request traces instead of the loaded ones."""

    def __init__(self, exp: ExperimentConfig, seed: int, traces: list[RequestTrace]) -> None:
        self.traces, self.seed = traces, seed


def resample_traces(traces: list[RequestTrace], rng: random.Random) -> list[RequestTrace]:
    """Requests with replacement, then each drawn request's rounds with replacement."""
    out = []
    for _ in traces:
        t = traces[rng.randrange(len(traces))]
        picks = [rng.randrange(len(t.rounds)) for _ in t.rounds]
        # a round's per-token draft features travel with it (confidence and DISCO read them)
        features = [t.features[i] for i in picks] if t.features else t.features
        out.append(RequestTrace([t.rounds[i] for i in picks], t.gamma, features))
    return out


PARALLEL_FROM_S = 6.0  # sequential seconds above which the resamples use every core (~2 s to start)


def _simulate(exp: ExperimentConfig, requests: list[Any], resampled: list[list[RequestTrace]], *,
              cost: Any, baseline_requests: Any) -> list[dict[str, float | None]]:
    """The METRICS of one prediction per resampled trace (same seed, prompts and cost model)."""
    from sim.runtime.simulate import simulate

    out = []
    for traces in resampled:
        oracle = ResampledTraceOracle(exp, exp.seed, traces)
        rounds, reqs, _ = simulate(exp, requests, seed=exp.seed, keep_spans=False, oracle=oracle,
                                  cost=cost).frames()
        s = summarize(rounds, reqs, exp.schedule.gamma, baseline_requests)
        out.append({m: s.get(m) for m in METRICS})
    return out


def parallel_workers(sequential_s: float) -> int:
    """Processes for resamples that would take ``sequential_s`` one after another: this process's
    cores when that is long enough to pay for starting them, and this is not itself a worker of
    a parallel sweep (joblib then runs nested work in its threading backend: level 1)."""
    import os

    from joblib.parallel import get_active_backend

    if sequential_s < PARALLEL_FROM_S or getattr(get_active_backend()[0], "nesting_level", 0) > 0:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prediction_interval(exp: ExperimentConfig, requests: list[Any], recorder: Any,
                        baseline: Any = None) -> dict[str, Any]:
    """Summary fields: ``<metric>_pi95`` = [low, high] for METRICS (those the prediction has),
    around the prediction `recorder` (and its `ar` `baseline`) of `requests`."""
    import time

    baseline_requests = baseline.frames()[1] if baseline is not None else None
    rounds, reqs, _ = recorder.frames()
    point = summarize(rounds, reqs, exp.schedule.gamma, baseline_requests)
    from sim.cost.base import make_cost_model

    traces = load_trace(exp)
    cost = make_cost_model(exp)  # once: a profile's load and rescale fit do not change
    rng = random.Random(exp.seed)
    resampled = [resample_traces(traces, rng) for _ in range(exp.sim.prediction_resamples)]
    t0 = time.perf_counter()
    results = _simulate(exp, requests, resampled[:1], cost=cost, baseline_requests=baseline_requests)
    rest = resampled[1:]
    workers = min(len(rest), parallel_workers((time.perf_counter() - t0) * len(rest)))
    if workers > 1:
        from joblib import Parallel, delayed

        size = -(-len(rest) // workers)  # contiguous chunks, one per worker, results in order
        chunks = [rest[i:i + size] for i in range(0, len(rest), size)]
        for part in Parallel(n_jobs=workers, backend="loky")(
                delayed(_simulate)(exp, requests, c, cost=cost, baseline_requests=baseline_requests) for c in chunks):
            results += part
    else:
        results += _simulate(exp, requests, rest, cost=cost, baseline_requests=baseline_requests)
    out: dict[str, Any] = {"prediction_resamples": exp.sim.prediction_resamples}
    for m in METRICS:
        values = [r[m] for r in results if r[m] is not None]
        if values and point.get(m) is not None:
            iv = percentile_interval(point[m], values)
            out[f"{m}_pi95"] = [iv.low, iv.high]
    return out
