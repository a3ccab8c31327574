"""The simulator backend: build the requests, run the schedule in SimPy, run its `ar` baseline.

Requests are served one after another (single-request latency, batch size 1, as in the seed
papers). The `ar` baseline runs the same requests with the target placed on every GPU the
experiment occupies (target_gpus, plus draft_gpus when the draft has GPUs of its own), so that
`speedup` compares speculation against plain decoding on the same hardware; for `decentralized`
it runs over the same pipeline of nodes and links (``ScheduleSpec.ar_baseline``). Schedules may add summary fields through
``ctx.extra`` (they land in summary.json).
"""

from __future__ import annotations

import copy
import sys
import time

import simpy

from sim.context import SimContext, SimRequest
from sim.cost import CostModel, make_cost_model
from sim.oracle import ORACLES, TokenOracle, make_oracle
from sim.schedules import get_schedule
from testbed.config import ExperimentConfig
from testbed.recorder import RunRecorder, RunResult
from testbed.schedules import ALL_DEVICES, BASELINE, SAME_PIPELINE, schedule_impl, spec_of


def baseline_experiment(exp: ExperimentConfig) -> ExperimentConfig:
    """The same experiment decoded autoregressively where its declaration places its `ar`
    baseline (``ScheduleSpec.ar_baseline``): on the target's GPUs, on every GPU its groups
    occupy (``all_devices``), or over its own pipeline of nodes (``same_pipeline``)."""
    where = spec_of(exp).ar_baseline
    base = copy.deepcopy(exp)
    base.schedule.name = BASELINE
    base.schedule.tree = False
    pl = exp.placement
    if where == ALL_DEVICES:
        base.placement.target_gpus = min(pl.target_gpus + pl.draft_gpus, exp.hardware.gpus_per_node)
    if where != SAME_PIPELINE:
        base.placement.nodes = 1  # only a pipelined schedule's `ar` keeps its nodes
    return base


def prompt_lengths(exp: ExperimentConfig) -> tuple[list[str], list[int]]:
    w = exp.workload
    if w.name == "synthetic":
        return [f"synthetic-{i}" for i in range(w.num_prompts)], [w.prompt_len] * w.num_prompts
    from testbed.workloads import choose_prompts, count_tokens

    prompts = choose_prompts(exp)
    return [p.id for p in prompts], count_tokens(prompts, exp)


def make_requests(exp: ExperimentConfig) -> list[SimRequest]:
    ids, lengths = prompt_lengths(exp)
    return [SimRequest(i, pid, n, exp.workload.max_new_tokens) for i, (pid, n) in enumerate(zip(ids, lengths))]


def simulate(exp: ExperimentConfig, requests: list[SimRequest], seed: int,
             keep_spans: bool = True, extra: dict | None = None, oracle: TokenOracle | None = None,
             cost: CostModel | None = None) -> RunRecorder:
    """Run the schedule over the requests; schedules' summary fields go into `extra`. `oracle`,
    `cost`: to use instead of the experiment's (sim/prediction_interval.py reuses one cost
    model over many resampled oracles)."""
    env = simpy.Environment()
    rec = RunRecorder(keep_spans=keep_spans)
    ctx = SimContext(exp=exp, env=env, cost=cost if cost is not None else make_cost_model(exp),
                     oracle=oracle if oracle is not None else make_oracle(exp, seed), rec=rec)
    schedule = get_schedule(schedule_impl(exp))

    def serve_all():  # type: ignore[no-untyped-def]
        for req in requests:
            yield env.process(schedule(ctx, req))

    env.process(serve_all())
    env.run()
    if exp.sim.profile_drift != "none":  # how much slower the machine is now than profiled
        ctx.extra["profile_drift_factor"] = round(getattr(ctx.cost, "drift", 1.0), 4)
        by_role = getattr(ctx.cost, "drift_by_role", {})
        if "draft" in by_role and spec_of(exp).drafts:
            ctx.extra["profile_drift_factor_draft"] = round(by_role["draft"], 4)
        if getattr(ctx.cost, "drift_k8", None) is not None:  # run_probe: the target's at 8 tokens
            ctx.extra["profile_drift_factor_k8"] = round(ctx.cost.drift_k8, 4)
    if extra is not None:
        extra.update(ctx.extra)
    return rec


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
        from sim.prediction_interval import prediction_interval  # <metric>_pi95

        extra.update(prediction_interval(exp, requests, rec, baseline))
    # wall-clock facts stay out of summary.json, which must be identical for the same seed
    info = {"sim_wall_s": wall, "sim_tokens_per_wall_s": generated / wall if wall > 0 else None}
    return RunResult(recorder=rec, baseline=baseline, extra=extra, artifacts={"run_info.json": info})
