"""A real `schedule=async` run: two disjoint device groups, one worker process per device.

``run_async(exp, placement)`` launches ``async_rank`` on every rank of the ``async`` placement
(testbed.placement: a ``target`` group and a ``draft`` group, TP inside each, the bridge
between their leaders). Each rank loads its group's model, shards it over its group
(real.model.tp), and serves the prompts with its half of the schedule
(real/schedules/async_tree.py: ``target_worker`` or ``draft_worker``). An eagle head's group
(one rank) holds the head and the target it reads the embedding, final norm and LM head of
(``eagle_hooks``); its target group sends it the features (real/runtime/async_messages.py).

``speedup`` needs ``ar`` on the target's devices: after the async requests the target group
runs ``ar`` SPMD on its own devices, alone (the draft group waits on the bridge, one message
per baseline request so no receive times out).

Records: the target leader records rounds and requests; both leaders record spans (draft
expand / re-root, target verify, the bridge's link spans) on the run clock shared by all
workers; ``real.runtime.launch.merge_records`` makes them one run (timeline.parquet).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from real.calibrate.probe_forward import (
    PROBE_TOKENS,
    RunProbe,
    model_probe,
    role_probes,
    target_probes,
)
from real.errors import RealSetupError
from real.model.eagle import EagleDraft
from real.model.eagle_tree import EagleTreeTokens
from real.model.runners import TargetRunner
from real.model.tree_tokens import LocalModel
from real.runtime.batching import serve_batched
from real.runtime.context import RealContext, RealRequest
from real.runtime.layouts import RUNNERS, Runner
from real.runtime.links import Kind, Message
from real.runtime.telemetry import Telemetry, run_files
from real.schedules import TwoGroups, get_schedule
from real.schedules.async_tree import Peer, Side
from testbed.arrivals import under_load
from testbed.config import ExperimentConfig, real_dtype
from testbed.placement import Placement
from testbed.recorder import RunRecorder, RunResult
from testbed.schedules import BASELINE, TWO_GROUPS, schedule_impl
from testbed.spec.ngram import NgramTreeSource
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import DraftSource


@dataclass
class AsyncServed:
    """What one rank of an async run sends back."""

    role: str
    outputs: list[list[int]]
    baseline: RunRecorder | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    telemetry: Any = None  # the target leader's samples (pandas frame) and their summary
    telemetry_summary: dict | None = None


def check_draft(exp: ExperimentConfig) -> None:
    d = exp.pair.draft
    if d.kind not in ("transformer", "ngram", "eagle"):
        raise RealSetupError(f"pair.draft={d.name!r} ({d.kind}) cannot grow a token tree on a device "
                             "group of its own: schedule=async needs a draft model (e.g. "
                             "pair=smollm2_135m+smollm2_draft, pair=smollm2_135m+smollm2_eagle, or "
                             "pair.draft=ngram3); use schedule=sync for this draft")


@dataclass
class Loaded:
    """What one group's process loads: its model (None for the n-gram draft and the eagle head,
    which prefill nothing), the eagle draft, the requests, EOS ids, the vocabulary size, the
    draft's KV slots (both groups tokenize the prompts alike)."""

    model: Any  # real.model.decoder.Transformer
    eagle: EagleDraft | None
    requests: list[RealRequest]
    eos: frozenset[int]
    vocab: int
    draft_slots: int


def _load(exp: ExperimentConfig, role: str, params: SamplingParams) -> Loaded:
    from real.model.drafts import ModelDraft
    from real.runtime.engine import cache_slots
    from real.runtime.loading import build_requests, load, make_draft, model_device, prepare_graphs

    t = exp.pair.target
    target, tokenizer = load(t.path, "pair.target", model_name=t.name, dtype=real_dtype(exp), device=model_device(exp),
                             cuda_graphs=exp.real.cuda_graphs)
    requests = build_requests(exp, tokenizer, target.args.max_seq_len)
    eos = frozenset() if exp.real.ignore_eos else frozenset(tokenizer.eos_token_ids)
    target_slots, draft_slots = cache_slots(exp, requests)
    loaded = Loaded(None, None, requests, eos, target.args.vocab_size, draft_slots)
    if role == "target":
        model, slots = target, target_slots
    elif exp.pair.draft.kind == "ngram":  # no model: the draft group only looks tokens up
        return loaded
    elif exp.pair.draft.kind == "eagle":
        # The head reads the target's embedding, final norm and LM head (shared, frozen). This
        # process keeps the whole target loaded above (it loads it for the tokenizer anyway)
        # rather than those three tensors alone: simpler, at the cost of the target's layers'
        # memory on the draft's device, where they never run.
        eagle = make_draft(exp, target, tokenizer, params)
        assert isinstance(eagle, EagleDraft)
        loaded.eagle = eagle
        return loaded
    else:
        draft = make_draft(exp, target, tokenizer, params)
        assert isinstance(draft, ModelDraft)  # check_draft ran in the launcher
        model, slots = draft.model, draft_slots
    if model.max_seq < slots:
        model.setup_cache(slots)
    prepare_graphs(exp, model)
    loaded.model = model
    return loaded


def ngram_source(exp: ExperimentConfig, params: SamplingParams, vocab: int,
                 ) -> Callable[[list[int], torch.Generator], DraftSource] | None:
    """The n-gram draft's tree source factory (testbed.spec.ngram); None for a model draft."""
    if exp.pair.draft.kind != "ngram":
        return None
    n, mode = exp.pair.draft.ngram, "topk" if params.greedy else "sample"
    return lambda ids, gen: NgramTreeSource(ids, ngram=n, vocab=vocab, mode=mode, generator=gen)


def eagle_hooks(draft: EagleDraft, params: SamplingParams, *, cache_slots: int,
                ) -> tuple[Callable[[list[int], torch.Generator], DraftSource],
                           Callable[[list[int], torch.Tensor | None], None]]:
    """An eagle head's (tree source factory, start) for the draft group's ``Side``: the source
    is the serial tree's (real.model.eagle_tree) with ``cache_slots`` KV slots of the head; the
    start takes the target's prompt features, or zeros for the probe's tree."""
    def source(ids: list[int], generator: torch.Generator) -> DraftSource:
        return EagleTreeTokens(draft, params, ids, cache_slots=cache_slots, generator=generator)

    def start(ids: list[int], features: torch.Tensor | None) -> None:
        if features is None:  # an expansion's cost does not depend on the features' values
            t = draft.target
            features = torch.zeros(max(0, len(ids) - 1), t.args.dim, dtype=t.dtype, device=t.device)
        draft.start(ids, features=features)
    return source, start


def _probes(role: str, model: Any, eagle: EagleDraft | None, params: SamplingParams) -> dict:
    """This group's probe forwards (RunProbe's fields): the target's; a draft model's one token
    and a tree expansion's size; the eagle head's one token (as in the serial schedules); none
    for the n-gram draft."""
    if eagle is not None:
        return role_probes(None, eagle, params)
    if model is None:
        return {}
    if role == "target":
        return target_probes(model, params)
    return {role: model_probe(model, params),
            f"{role}_k8": model_probe(model, params, tokens=PROBE_TOKENS, distributions=False)}


def async_rank(ctx) -> AsyncServed:  # type: ignore[no-untyped-def]  # ctx: real.runtime.worker.WorkerContext
    """One rank of an async run (module level: spawned workers import it)."""
    from real.model.tp import apply_tp

    exp, role = ctx.exp, ctx.role
    s = exp.schedule
    halves = get_schedule(schedule_impl(exp))  # the schedule's two halves (real/schedules)
    assert isinstance(halves, TwoGroups)
    params = SamplingParams(exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p)
    other = "draft" if role == "target" else "target"
    peer = Peer(ctx.transport_from(other) if ctx.is_leader else None,
                ctx.transport_to(other) if ctx.is_leader else None, ctx.broadcast_decision)
    with torch.inference_mode():
        loaded = _load(exp, role, params)
        model, eagle, requests, eos = loaded.model, loaded.eagle, loaded.requests, loaded.eos
        if ctx.group.tp > 1 and model is not None:  # (validation refuses an eagle head under TP)
            apply_tp(model, rank=ctx.info.index, world=ctx.group.tp, group=ctx.tp_group(),
                     allreduce=exp.real.allreduce)
        rec = ctx.rec if ctx.is_leader else RunRecorder()
        probe = RunProbe(_probes(role, model, eagle, params),
                         group=ctx.tp_group() if ctx.group.tp > 1 else None, requests=len(requests))
        source, start = (eagle_hooks(eagle, params, cache_slots=loaded.draft_slots) if eagle is not None
                         else (ngram_source(exp, params, loaded.vocab), None))
        side = Side(model, LocalModel(model) if model is not None else None, params, peer, rec,
                    ctx.now, exp.seed, draft_source=source, probe=probe, start_features=start,
                    reply_features=role == "target" and exp.pair.draft.kind == "eagle")
        served = AsyncServed(role, [])
        if under_load(exp.workload):  # many requests in flight: real/runtime/batching_async.py
            _serve_under_load(ctx, halves, side, served, requests=requests, eos=eos, params=params, eagle=eagle)
        elif role == "target":
            # an eagle head's target keeps its hidden states in every forward of the run, the
            # probes' too (such forwards run eagerly: a CUDA graph replays logits only)
            model.keep_hidden = side.reply_features
            telemetry = Telemetry(exp.real.device)
            with telemetry if ctx.is_leader else contextlib.nullcontext():
                halves.probe_target(side, exp, requests[0])
                for req in requests:
                    halves.before_request(side, role, req)
                    served.outputs.append(halves.target(side, req, eos))
            if ctx.is_leader:
                served.telemetry, served.telemetry_summary = telemetry.frame(), telemetry.summary()
            model.keep_hidden = False  # `ar` reads no features (and may then replay CUDA graphs)
            served.baseline = _baseline(exp, model, params=params, requests=requests, eos=eos, peer=peer)
        else:
            depth, t_target, t_draft = halves.probe_draft(side, exp, requests[0])
            for req in requests:
                halves.before_request(side, role, req)
                halves.draft(side, req, depth, width=s.tree_width, budget=s.tree_budget)
            _idle_during_baseline(exp, requests, peer)
            served.extra = {**depth.summary_fields(), "t_target_ms": 1e3 * t_target,
                            "t_draft_ms": 1e3 * t_draft, "tree_width": s.tree_width,
                            "tree_budget": s.tree_budget, "tree_kv_reuse": side.kv.reuse,
                            "draft_rows": side.rows.rows}
        served.extra.update({f"async_{k}_s": v for k, v in side.overhead.items()})
        served.extra.update({k: v for k, v in probe.fields().items() if k != "probe_points" or role == "target"})
    if not ctx.is_leader:
        ctx.rec = RunRecorder()
    return served


def _serve_under_load(ctx, halves: TwoGroups, side: Side, served: AsyncServed, *,  # type: ignore[no-untyped-def]
                      requests: list[RealRequest], eos: frozenset[int], params: SamplingParams,
                      eagle: EagleDraft | None = None) -> None:
    """Both groups under load: d's probe and one drift probe each (the requests overlap), the
    batched rounds, then the target's `ar` at the same load while the draft waits."""
    from real.runtime import batching_async
    from real.runtime.engine import cache_slots
    from testbed.admission import refuse_oversized

    refuse_oversized(ctx.exp, requests)  # both groups, before either waits on the other

    exp, role, s = ctx.exp, ctx.role, ctx.exp.schedule
    if role == "target":
        telemetry = Telemetry(exp.real.device)
        with telemetry if ctx.is_leader else contextlib.nullcontext():
            halves.probe_target(side, exp, requests[0])
            halves.before_request(side, role, requests[0])
            served.outputs = batching_async.target_server(side, exp, requests, eos,
                                                          slots=cache_slots(exp, requests)[0])
        if ctx.is_leader:
            served.telemetry, served.telemetry_summary = telemetry.frame(), telemetry.summary()
        if exp.real.baseline:
            t0 = time.perf_counter()
            base = RealContext(exp, TargetRunner(side.model, params), None, RunRecorder(), eos, params,
                               batching_async.heartbeat(side.peer, lambda: time.perf_counter() - t0), t0)
            serve_batched(base, requests, max_seq=cache_slots(exp, requests)[0])
            side.peer.send(Message(Kind.DATA, round=batching_async.BASELINE_DONE))
            served.baseline = base.rec
        return
    depth, t_target, t_draft = halves.probe_draft(side, exp, requests[0])
    halves.before_request(side, role, requests[0])
    batching_async.draft_server(side, exp, requests, depth, eagle=eagle)
    if exp.real.baseline:
        batching_async.wait_for_baseline(side.peer)
    served.extra = {**depth.summary_fields(), "t_target_ms": 1e3 * t_target, "t_draft_ms": 1e3 * t_draft,
                    "tree_width": s.tree_width, "tree_budget": s.tree_budget, "tree_kv_reuse": side.kv.reuse,
                    "draft_rows": side.rows.rows}


def _baseline(exp: ExperimentConfig, model, *, params: SamplingParams, requests, eos,  # type: ignore[no-untyped-def]
              peer: Peer) -> RunRecorder | None:
    """`ar` on the target group alone; a message to the draft after each request."""
    if not exp.real.baseline:
        return None
    serve_ar = get_schedule(BASELINE)
    ctx = RealContext(exp, TargetRunner(model, params), None, RunRecorder(), eos, params,
                      lambda n: None, time.perf_counter())
    for req in requests:
        serve_ar(ctx, req)
        peer.send(Message(Kind.DATA, request_id=req.request_id))
    return ctx.rec


def _idle_during_baseline(exp: ExperimentConfig, requests, peer: Peer) -> None:  # type: ignore[no-untyped-def]
    if exp.real.baseline:
        for _ in requests:
            peer.recv()


def run_async(exp: ExperimentConfig, placement: Placement) -> RunResult:
    from real.runtime.launch import launch, merge_records

    check_draft(exp)
    results = launch(exp, async_rank, placement=placement)
    if not results:  # torchrun: not rank 0
        return RunResult(recorder=RunRecorder(), baseline=None, extra={"writer": False})
    target = [r for r in results if r.role == "target"]
    leader = min(target, key=lambda r: r.rank)
    for other in target:
        if other.value.outputs != leader.value.outputs:
            raise RealSetupError(
                f"rank {other.rank} (target) generated other tokens than rank {leader.rank}: the "
                "ranks of the target group diverged (non-deterministic all-reduce?); rerun with "
                "real.allreduce=gloo")
    draft = min((r for r in results if r.role == "draft"), key=lambda r: r.rank)
    extra = {"draft": exp.pair.draft.name, "dtype": real_dtype(exp), "threads": 1,
             "workload_split": exp.workload.split, "max_new_tokens": exp.workload.max_new_tokens,
             "processes": len(results), "allreduce": exp.real.allreduce,
             **draft.value.extra, **leader.value.extra}
    return RunResult(recorder=merge_records(results), baseline=leader.value.baseline, extra=extra,
                     artifacts=run_files(leader.value.telemetry, leader.value.telemetry_summary))


RUNNERS.register(TWO_GROUPS, Runner(run_async, launches_per_run=True))
