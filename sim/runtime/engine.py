"""The simulator backend: build the requests, run the schedule in SimPy, run its `ar` baseline.

Requests are served one after another (single-request latency, batch size 1, as in the seed
papers). The `ar` baseline runs the same requests with the target placed on every GPU the
experiment occupies (target_gpus, plus draft_gpus when the draft has GPUs of its own), so that
`speedup` compares speculation against plain decoding on the same hardware; for `decentralized`
it runs over the same pipeline of nodes and links (``ScheduleSpec.ar_baseline``). Schedules may add summary fields through
``ctx.extra`` (they land in summary.json).
"""

from __future__ import annotations

import sys
import time

from sim.cost.base import make_cost_model
from sim.oracle.base import ORACLES
from sim.runtime.simulate import baseline_experiment, make_requests, prompt_lengths, simulate  # noqa: F401
from sim.schedules import get_schedule
from testbed.config import ExperimentConfig
from testbed.recorder import RunResult
from testbed.schedules import BASELINE, schedule_impl, spec_of


def run(exp: ExperimentConfig) -> RunResult:
    # The oracles' tensors are tiny: torch's intra-op threads only add synchronisation (a
    # softmax over 8 floats takes ms instead of µs when the cores are busy). One thread.
    # torch is imported only by the schedules and oracles that need it (not sync + iid)
    get_schedule(schedule_impl(exp))
    get_schedule(BASELINE)
    ORACLES.get(exp.acceptance.oracle)
    torch = sys.modules.get("torch")
    if torch is None:
        return _run(exp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(exp)
    finally:
        torch.set_num_threads(threads)


def _run(exp: ExperimentConfig) -> RunResult:
    requests = make_requests(exp)
    t0 = time.perf_counter()
    schedule_extra: dict = {}
    cost = make_cost_model(exp)
    rec = simulate(exp, requests, seed=exp.seed, extra=schedule_extra, cost=cost)
    wall = time.perf_counter() - t0
    baseline = None
    if spec_of(exp).ar_baseline is not None:
        base, base_cost = baseline_experiment(exp), None
        if exp.sim.profile_drift == "run_probe":
            # the real run's `ar` baseline ran in its processes: the prediction's drift holds for it
            base.sim.profile_drift = "none"
            base_cost = make_cost_model(base)
            base_cost.apply_drift({"target": cost.drift_by_role["target"]})  # type: ignore[attr-defined]
        baseline = simulate(base, requests, seed=exp.seed + 1, keep_spans=False, cost=base_cost)
    generated = sum(r["generated"] for r in rec.requests)
    extra = {"cost_model": exp.sim.cost_model, "oracle": exp.acceptance.oracle,
             "alpha_config": exp.acceptance.alpha if exp.acceptance.oracle != "trace" else None,
             "sim_c": exp.sim.c if exp.sim.cost_model == "analytic" else None,
             **schedule_extra}
    if exp.sim.prediction_resamples and exp.acceptance.oracle == "trace":
        from sim.runtime.prediction_interval import prediction_interval  # <metric>_pi95

        extra.update(prediction_interval(exp, requests, rec, baseline))
    # wall-clock facts stay out of summary.json, which must be identical for the same seed
    info = {"sim_wall_s": wall, "sim_tokens_per_wall_s": generated / wall if wall > 0 else None}
    return RunResult(recorder=rec, baseline=baseline, extra=extra, artifacts={"run_info.json": info})
