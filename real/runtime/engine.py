"""The real backend: load the pair (real.runtime.loading), serve the workload's prompts one after
another (batch 1) with the schedule of real/schedules, time every round on the wall clock and
record it exactly as the simulator does.

Schedules mirror sim/schedules: ``ar`` feeds one token per target forward; ``sync`` drafts γ
guesses, verifies them in one target forward over γ+1 tokens and accepts with
testbed.spec.speculative.speculative_step — the same Algorithm 1 the simulator's oracles call.
``speedup`` needs ``ar`` on the same prompts: it runs after the schedule (``real.baseline``)
and is memoised per process, so a sweep measures it once per prompt set and sampling setting.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from real.calibrate.probe_forward import RunProbe, role_probes
from real.errors import RealSetupError
from real.model.decoder import Transformer
from real.model.drafts import Draft, ModelDraft
from real.model.runners import TargetRunner
from real.model.tree_tokens import tree_cache_slots
from real.runtime.context import RealContext, RealRequest
from real.runtime.layouts import RUNNERS, Runner
from real.runtime.loading import build_requests, load, make_draft, model_device, prepare_graphs
from real.runtime.telemetry import Telemetry, run_files
from real.schedules import get_schedule
from testbed.arrivals import under_load
from testbed.config import ExperimentConfig, as_dict, real_dtype
from testbed.placement import Placement
from testbed.recorder import RunRecorder, RunResult
from testbed.schedules import (
    BASELINE,
    SINGLE,
    TREE,
    implementations,
    runs_on,
    schedule_impl,
    spec,
    spec_of,
)
from testbed.spec.sampling import SamplingParams

_BASELINES: dict[str, RunRecorder] = {}


# --------------------------------------------------------------------------------------- run
@contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _progress(total: int, enabled: bool, desc: str):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False, dynamic_ncols=True)


def serve(exp: ExperimentConfig, schedule: str, target: Transformer, draft: Draft | None, *,
          requests: list[RealRequest], eos: frozenset[int], progress: bool,
          extra: dict | None = None, probe: RunProbe | None = None, group: Any = None) -> RunRecorder:
    """Serve the requests one after another (or under load, batched); the schedule's summary
    fields go into ``extra`` (with ``probe``'s, taken before every request; under load before
    and after serving)."""
    if not runs_on("real", schedule):
        raise RealSetupError(f"schedule={schedule} is not available on backend=real yet: "
                             f"use one of {', '.join(implementations('real'))} (or backend=sim)")
    serve_one = get_schedule(schedule)
    params = SamplingParams(exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p)
    rec = RunRecorder()
    total = sum(r.max_new_tokens for r in requests)
    with _progress(total, progress, f"real {schedule}") as bar:
        ctx = RealContext(exp, TargetRunner(target, params), draft, rec, eos, params, bar.update,
                          time.perf_counter())
        if under_load(exp.workload):  # continuous batching (real/runtime/batching.py)
            from real.runtime.batching import serve_batched
            from testbed.admission import refuse_oversized

            refuse_oversized(exp, requests)  # (else it would wait for room forever)

            # the machine as the run finds it: the requests overlap, so no reading can sit between
            # them; one before and one after bracket the run without delaying a round (one
            # reading caught in a neighbour's burst put the verifications of a prediction 55 %
            # above the run's own, at the same rounds' speed)
            if probe is not None:
                probe.take(0)
            serve_batched(ctx, requests, max_seq=cache_slots(exp, requests)[0], group=group)
            if probe is not None:
                probe.take(0)
        else:
            for i, req in enumerate(requests):
                if probe is not None:
                    probe.take(i)
                serve_one(ctx, req)
    if extra is not None:
        extra.update(ctx.extra)
        extra.update(probe.fields() if probe is not None else {})
    return rec


def baseline_key(exp: ExperimentConfig, requests: list[RealRequest]) -> str:
    key = {"target": as_dict(exp.pair.target), "real": as_dict(exp.real), "sampling": as_dict(exp.sampling),
           "seed": exp.seed, "requests": [(r.prompt_id, r.prompt_ids, r.max_new_tokens) for r in requests]}
    if under_load(exp.workload):  # `ar` at the same load
        w = exp.workload
        key["load"] = [w.arrival, w.concurrency, w.rate, w.trace_path, as_dict(exp.serving)]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cache_slots(exp: ExperimentConfig, requests: list[RealRequest]) -> tuple[int, int]:
    """KV slots (target, draft) the longest request needs: its sequence and the draft window;
    for token trees the target's verification batch, and the draft's tree slots alive at once
    (``tree_cache_slots``: the model's whole context where it can)."""
    s = exp.schedule
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    if s.tree or spec_of(exp).tree:
        return longest + s.tree_budget + 2, tree_cache_slots(longest)
    return longest + s.gamma + 2, longest + s.gamma + 2


def run(exp: ExperimentConfig) -> RunResult:
    """A real run, by the runner of its placement's layout (real/runtime/layouts.py). The
    placement is made here, once, and handed to the runner and the processes it starts."""
    from real.runtime.launch import run_placement

    placement = run_placement(exp)
    runner = RUNNERS.get(placement.layout)
    if runner.launches_per_run and exp.real.repeats > 1:
        # its processes are launched per run: repeat whole runs (each the schedule, then ar)
        from real.runtime.repeats import run_repeated

        return run_repeated(exp, run, schedule_impl(exp))
    return runner.run(exp, placement)


def run_group(exp: ExperimentConfig, placement: Placement) -> RunResult:
    """The ``single`` and ``tree`` layouts: this process, or one SPMD group of worker processes
    (one per device) that all serve the schedule on their shards."""
    if placement.world_size > 1:
        return _run_spawned(exp, placement)
    with _threads(exp.real.threads), torch.inference_mode():
        return _run(exp)


@dataclass
class _Served:
    """What one rank of a run produces (picklable, sent back to the launcher)."""

    rec: RunRecorder
    baseline: RunRecorder | None
    extra: dict
    telemetry: object = None  # pandas frame (leader)
    telemetry_summary: dict | None = None


def _serve_all(exp: ExperimentConfig, tp: tuple[int, int, object] | None, leader: bool) -> _Served:
    """Load, serve the prompts with the schedule and then ``ar``; ``tp`` = (index, degree,
    process group) shards both models over a tensor-parallel group first."""
    t = exp.pair.target
    target, tokenizer = load(t.path, "pair.target", model_name=t.name, dtype=real_dtype(exp), device=model_device(exp),
                             cuda_graphs=exp.real.cuda_graphs)
    params = SamplingParams(exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p)
    draft = make_draft(exp, target, tokenizer, params)
    group = None if tp is None else tp[2]  # under load its leader admits for every rank
    if tp is not None:
        shard_models(target, draft, tp, exp.real.allreduce)
    requests = build_requests(exp, tokenizer, target.args.max_seq_len)
    target_slots, draft_slots = cache_slots(exp, requests)
    if target.max_seq < target_slots:
        target.setup_cache(target_slots)
    if isinstance(draft, ModelDraft) and draft.model.max_seq < draft_slots:
        draft.model.setup_cache(draft_slots)
    prepare_graphs(exp, target, draft.model if isinstance(draft, ModelDraft) else None)
    eos = frozenset() if exp.real.ignore_eos else frozenset(tokenizer.eos_token_ids)
    progress = exp.real.progress and leader
    telemetry = Telemetry(exp.real.device)
    # the machine as this run finds it, on its own devices, before each request it decodes
    drafts = spec_of(exp).drafts
    probe = RunProbe(role_probes(target, draft if drafts else None, params),
                     group=None if tp is None else tp[2], requests=len(requests))
    schedule_extra: dict = {}
    want_baseline = drafts and exp.real.baseline
    if exp.real.repeats > 1:  # interleaved: the run, ar, the run, ar, ... (real/runtime/repeats.py)
        from real.runtime.repeats import serve_interleaved

        def measure(impl: str, extra: dict | None) -> RunRecorder:
            has_draft = spec(impl).drafts
            return serve(exp, impl, target, draft if has_draft else None, requests=requests, eos=eos,
                         progress=progress, extra=extra, probe=probe if has_draft or not drafts else None,
                         group=group)
        with telemetry if leader else contextlib.nullcontext():
            rec, baseline, repeat_fields = serve_interleaved(
                schedule_impl(exp), exp.real.repeats, baseline=want_baseline, measure=measure, schedule_extra=schedule_extra, seed=exp.seed)
        schedule_extra.update(repeat_fields)
        want_baseline = False
    else:
        with telemetry if leader else contextlib.nullcontext():
            rec = serve(exp, schedule_impl(exp), target, draft, requests=requests, eos=eos, progress=progress,
                        extra=schedule_extra, probe=probe, group=group)
        baseline = None
    if want_baseline:
        key = baseline_key(exp, requests)
        if key not in _BASELINES:
            _BASELINES[key] = serve(exp, BASELINE, target, None, requests=requests, eos=eos, progress=progress,
                                    group=group)
        baseline = _BASELINES[key]
    extra = {"draft": None if draft is None else draft.name, "dtype": real_dtype(exp),
             "threads": torch.get_num_threads(), "workload_split": exp.workload.split,
             "max_new_tokens": exp.workload.max_new_tokens, **schedule_extra}
    if not leader:
        return _Served(rec, baseline, extra)
    return _Served(rec, baseline, extra, telemetry.frame(), telemetry.summary())


def shard_models(target: Transformer, draft: Draft | None, tp: tuple[int, int, object],
                 allreduce: str) -> None:
    """Tensor parallelism over the group: the target, and the draft model when it has one of
    its own (an early-exit draft shares the target's layers, an n-gram draft has none)."""
    from real.model.tp import apply_tp

    index, degree, group = tp
    apply_tp(target, rank=index, world=degree, group=group, allreduce=allreduce)
    if isinstance(draft, ModelDraft):
        apply_tp(draft.model, rank=index, world=degree, group=group, allreduce=allreduce)


def serve_worker(ctx) -> _Served:  # type: ignore[no-untyped-def]  # ctx: real.runtime.worker.WorkerContext
    """One rank of a multi-process `ar`/`sync`/serial-tree run. Every rank of the group runs the
    same schedule on its shard (SPMD): all-reduced activations and the replicated LM head give
    every rank the same logits bit for bit, and the same seeds give the same decisions, so the
    ranks enter the same collectives with no per-forward broadcast. The leader's records are the
    run's; the others' outputs are compared with them (a divergence is an error, not a hang)."""
    exp = ctx.exp
    group = ctx.group
    tp = (ctx.info.index, group.tp, ctx.tp_group()) if group.tp > 1 else None
    with torch.inference_mode():
        served = _serve_all(exp, tp, ctx.is_leader)
    ctx.rec = served.rec if ctx.is_leader else RunRecorder()
    return served


def _run_spawned(exp: ExperimentConfig, placement: Placement) -> RunResult:
    from real.runtime.launch import launch

    results = launch(exp, serve_worker, placement=placement)
    if not results:  # torchrun: not rank 0
        return RunResult(recorder=RunRecorder(), baseline=None, extra={"writer": False})
    leader = min(results, key=lambda r: r.rank).value
    for other in results:
        mine = [r["output_ids"] for r in other.value.rec.requests]
        if mine != [r["output_ids"] for r in leader.rec.requests]:
            raise RealSetupError(
                f"rank {other.rank} ({other.role}) generated other tokens than rank 0: the ranks of "
                "a tensor-parallel group diverged (non-deterministic all-reduce?); rerun with "
                "real.allreduce=gloo")
    extra = {**leader.extra, "processes": len(results), "allreduce": exp.real.allreduce}
    return RunResult(recorder=leader.rec, baseline=leader.baseline, extra=extra,
                     artifacts=run_files(leader.telemetry, leader.telemetry_summary))


def _run(exp: ExperimentConfig) -> RunResult:
    served = _serve_all(exp, None, True)
    return RunResult(recorder=served.rec, baseline=served.baseline, extra=served.extra,
                     artifacts=run_files(served.telemetry, served.telemetry_summary))


_GROUP = Runner(run_group)
RUNNERS.register(SINGLE, _GROUP)
RUNNERS.register(TREE, _GROUP)
