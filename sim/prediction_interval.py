"""Prediction intervals for trace-replay predictions (``sim.prediction_resamples=B``).

A prediction with ``acceptance=trace`` replays the acceptance of a few recorded prompts; had
other prompts been recorded it would differ. The interval resamples what the prediction rests
on: the trace's requests (prompts) with replacement, and within each drawn request its rounds
(drafted, accepted) with replacement — a two-stage bootstrap like testbed/stats.py's over
measured values — and simulates the experiment again on each of the B resampled traces (same
seed, same prompts, same cost model). The percentile interval of the B predictions is the 95%
prediction interval, reported beside the point prediction as ``<metric>_pi95``; the `ar`
baseline replays no acceptance, so it is not resampled (speedup's interval is tokens/s's over it).
"""

from __future__ import annotations

import random
from typing import Any

from sim.oracle_trace import RequestTrace, TraceOracle, load_trace
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


def prediction_interval(exp: ExperimentConfig, requests: list[Any], recorder: Any,
                        baseline: Any = None) -> dict[str, Any]:
    """Summary fields: ``<metric>_pi95`` = [low, high] for METRICS (those the prediction has),
    around the prediction `recorder` (and its `ar` `baseline`) of `requests`."""
    from sim.engine import simulate

    baseline_requests = baseline.frames()[1] if baseline is not None else None
    rounds, reqs, _ = recorder.frames()
    point = summarize(rounds, reqs, exp.schedule.gamma, baseline_requests)
    from sim.cost import make_cost_model

    traces = load_trace(exp)
    cost = make_cost_model(exp)  # once: a profile's load and rescale fit do not change
    rng = random.Random(exp.seed)
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    for _ in range(exp.sim.prediction_resamples):
        oracle = ResampledTraceOracle(exp, exp.seed, resample_traces(traces, rng))
        rounds, reqs, _ = simulate(exp, requests, seed=exp.seed, keep_spans=False, oracle=oracle,
                                  cost=cost).frames()
        s = summarize(rounds, reqs, exp.schedule.gamma, baseline_requests)
        for m in METRICS:
            if s.get(m) is not None:
                samples[m].append(s[m])
    out: dict[str, Any] = {"prediction_resamples": exp.sim.prediction_resamples}
    for m, values in samples.items():
        if values and point.get(m) is not None:
            iv = percentile_interval(point[m], values)
            out[f"{m}_pi95"] = [iv.low, iv.high]
    return out
