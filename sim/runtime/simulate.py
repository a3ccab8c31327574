"""The simulation itself: a run's requests, its `ar` baseline's experiment, and one pass of a
schedule over the requests in SimPy (``simulate``). sim/runtime/engine.py makes a run of it (baseline,
summary fields, prediction intervals); sim/runtime/prediction_interval.py simulates resampled traces.
"""

from __future__ import annotations

import copy

import simpy

from sim.cost.base import CostModel, make_cost_model
from sim.oracle.base import TokenOracle, make_oracle
from sim.runtime.context import SimContext, SimRequest
from sim.schedules import get_schedule
from testbed.arrivals import arrival_times, read_trace, under_load
from testbed.config import ExperimentConfig
from testbed.recorder import RunRecorder
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
    """The run's requests: the prompt set's, or under ``workload.arrival=trace`` one per trace
    row with the row's prompt and output lengths (the prompt set's ids, cycled)."""
    ids, lengths = prompt_lengths(exp)
    if exp.workload.arrival == "trace":
        rows = read_trace(exp.workload.trace_path)
        return [SimRequest(i, ids[i % len(ids)], row.prompt_tokens, row.output_tokens)
                for i, row in enumerate(rows)]
    return [SimRequest(i, pid, n, exp.workload.max_new_tokens) for i, (pid, n) in enumerate(zip(ids, lengths))]


def simulate(exp: ExperimentConfig, requests: list[SimRequest], *, seed: int,
             keep_spans: bool = True, extra: dict | None = None, oracle: TokenOracle | None = None,
             cost: CostModel | None = None, batched: bool | None = None) -> RunRecorder:
    """Run the schedule over the requests; schedules' summary fields go into `extra`. `oracle`,
    `cost`: to use instead of the experiment's (sim/runtime/prediction_interval.py reuses one cost
    model over many resampled oracles). ``batched``: serve through sim/runtime/batching.py
    (default: when the workload puts the run under load)."""
    env = simpy.Environment()
    rec = RunRecorder(keep_spans=keep_spans)
    ctx = SimContext(exp=exp, env=env, cost=cost if cost is not None else make_cost_model(exp),
                     oracle=oracle if oracle is not None else make_oracle(exp, seed), rec=rec)
    schedule = get_schedule(schedule_impl(exp))

    def serve_all():  # type: ignore[no-untyped-def]
        for req in requests:
            yield env.process(schedule(ctx, req))

    if under_load(exp.workload) if batched is None else batched:
        from sim.runtime.batching import serve
        from sim.runtime.pipelined import serve_pipelined
        from testbed.admission import refuse_oversized

        refuse_oversized(exp, requests)
        arrivals = arrival_times(exp, len(requests))
        if exp.placement.nodes > 1:  # a pipeline: requests in flight through its stages
            env.process(serve_pipelined(ctx, requests, schedule, arrivals=arrivals))
        else:
            env.process(serve(ctx, requests, arrivals=arrivals))
    else:
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
