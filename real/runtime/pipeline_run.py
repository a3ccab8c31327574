"""A real pipeline run: `decentralized` (DSD), or `ar` with ``placement.nodes > 1``, on one stage
process per node of the ``pipeline`` placement (testbed.placement), joined in a ring by emulated
``network=`` links (real/runtime/links.py).

``run_pipeline(exp, placement)`` launches ``pipeline_rank`` on every rank. Each loads the target, caches only
its own layers, and serves: the first stage drives the requests (real/schedules/decentralized.py
``dsd_flow``, or real/runtime/pipeline.py ``ar_flow``), the others run ``stage_worker``. As in
the simulator, ``speedup`` compares against `ar` over the *same* pipeline: after the schedule's
requests the first stage serves them again with ``ar_flow`` (phase 1; its records are the
baseline's, its spans stay out of the timeline). Under load (``workload.arrival``, more than one
request in flight) both are served with several requests in flight, each on a KV-cache row of
its own on every stage (real/runtime/pipelined.py), the baseline at the same load.

Quality of τ > 0 (summary): ``target_nll_per_token`` (the target's NLL of the emitted tokens from
the last stage's verification logits; ``baseline_nll_per_token`` for `ar`), and, against a
lossless reference — the `ar` baseline's outputs at temperature 0, where lossless decoding is
deterministic — ``identical_share`` (outputs equal token for token) and
``first_divergence_mean`` (the first differing position, an identical output counting its
length). At temperature > 0 the reference is the τ = 0 run of the same grid point with the same
seed (its random streams are coupled to this run's): the report pairs them
(testbed.metrics.divergence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from real.calibrate.probe_forward import PROBE_CONTEXT, PROBE_TOKENS, RunProbe, role_probes
from real.errors import RealSetupError
from real.runtime.layouts import RUNNERS, Runner
from real.runtime.pipeline import (
    BASELINE_PHASE,
    SCHEDULE_PHASE,
    Stage,
    ar_flow,
    run_alone,
    stage_worker,
    stop,
    summary_fields,
)
from real.runtime.telemetry import Telemetry, run_files
from real.schedules import get_schedule
from real.schedules.decentralized import (
    WindowVerifier,
    alpha_from_tokens,
    make_verifier,
    sends_dists,
)
from testbed.arrivals import under_load
from testbed.config import ExperimentConfig, real_dtype
from testbed.metrics import divergence
from testbed.placement import Placement
from testbed.recorder import RunRecorder, RunResult
from testbed.schedules import PIPELINE, schedule_impl, spec_of
from testbed.spec.dsd import draft_params
from testbed.spec.sampling import SamplingParams


@dataclass
class StageServed:
    """What one stage process sends back."""

    index: int
    outputs: list[list[int]] = field(default_factory=list)
    baseline: RunRecorder | None = None
    schedule_end_s: float = float("inf")  # run clock: the schedule's requests are done
    compute_s: dict[tuple[int, int], float] = field(default_factory=dict)
    nll: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (phase, request) -> per token
    key: int = 0
    drafted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    telemetry: Any = None  # the first stage's samples while it serves (pandas frame), their summary
    telemetry_summary: dict | None = None


def check(exp: ExperimentConfig) -> None:
    if exp.placement.target_gpus != 1:
        raise RealSetupError(f"placement.target_gpus={exp.placement.target_gpus}: the real pipeline "
                             "runs one process per stage (set placement.target_gpus=1)")
    if spec_of(exp).drafts and exp.pair.draft.kind == "early_exit":
        raise RealSetupError(f"pair.draft={exp.pair.draft.name!r} (early exit) needs the target's "
                             f"first layers on the draft's node; with schedule={exp.schedule.name} use a draft "
                             "model or the n-gram draft")


def pipeline_rank(ctx) -> StageServed:  # type: ignore[no-untyped-def]  # ctx: real.runtime.worker.WorkerContext
    """One stage process (module level: spawned workers import it)."""
    from real.runtime.batching import batch_rows
    from real.runtime.engine import cache_slots
    from real.runtime.loading import build_requests, load, make_draft, model_device

    exp = ctx.exp
    stages = ctx.placement.stages()
    names = [g.name for g in stages]
    index, count = names.index(ctx.group.name), len(stages)
    sp = exp.sampling
    params = SamplingParams(sp.temperature, sp.top_k, sp.top_p)
    served = StageServed(index)
    with torch.inference_mode():
        t = exp.pair.target
        target, tokenizer = load(t.path, "pair.target", model_name=t.name, dtype=real_dtype(exp), device=model_device(exp),
                             cuda_graphs=exp.real.cuda_graphs)
        if target.args.n_layers != t.layers:  # the placement split the preset's layers
            raise RealSetupError(f"pair.target.layers={t.layers} but {t.path or t.name} has "
                                 f"{target.args.n_layers} layers: set pair.target.layers="
                                 f"{target.args.n_layers}")
        requests = build_requests(exp, tokenizer, target.args.max_seq_len)
        slots, draft_slots = cache_slots(exp, requests)
        layers = stages[index].layers
        assert layers is not None
        # under load a KV-cache row per request in flight, after the prefill row 0
        rows = batch_rows(exp, len(requests)) if under_load(exp.workload) else 0
        if rows:
            from testbed.admission import refuse_oversized

            refuse_oversized(exp, requests)  # every stage, before any waits on another
        target.setup_cache(max(slots, PROBE_CONTEXT + 2), max_batch=rows + 1, layers=layers)
        stage = Stage(target, layers, index, count,
                      ctx.transport_from(names[index - 1]) if count > 1 else None,
                      ctx.transport_to(names[(index + 1) % count]) if count > 1 else None,
                      ctx.rec, ctx.now)
        # an eagle head on the first stage reads the target's features: the last stage returns them
        stage.features = spec_of(exp).drafts and exp.pair.draft.kind == "eagle"
        verifiers: dict[tuple[int, int], WindowVerifier] = {}
        vocab = target.args.vocab_size

        def make_verify(msg) -> WindowVerifier:  # type: ignore[no-untyped-def]
            v = make_verifier(exp, vocab, msg.request_id, baseline=msg.version == BASELINE_PHASE)
            verifiers[(msg.version, msg.request_id)] = v
            return v

        if count > 1:  # every stage loaded before the first window: no receive waits on a load
            import torch.distributed as dist

            dist.barrier()
        served.extra["probe_stage"] = _probe_stages(stage, params)
        if index == 0:
            _first_stage(stage, exp, served=served, requests=requests, tokenizer=tokenizer, target=target,
                         params=params, draft_slots=draft_slots, rows=rows, make_verify=make_verify,
                         make_draft=make_draft)
        else:
            stage_worker(stage, make_verify)
        served.compute_s = dict(stage.compute_s)
        for key, v in verifiers.items():
            served.nll[key] = v.nll
            if key[0] == SCHEDULE_PHASE:
                served.key += v.key
                served.drafted += v.drafted
    return served


def _probe_stages(stage: Stage, params: SamplingParams) -> dict[str, float]:
    """This stage's share of the target's probe forwards (one and ``PROBE_TOKENS`` tokens at
    ``PROBE_CONTEXT`` through its layers; the last stage's head and distributions included),
    timed stage by stage, each alone as a window visits them: their sums are the whole
    target's probes (``probe_target_s``, ``probe_target_k8_s``)."""
    import torch.distributed as dist

    from testbed.spec.sampling import standardize

    m = stage.model

    def forward(tokens: int) -> Callable[[], None]:
        x = (torch.ones(1, tokens, dtype=torch.long, device=m.device) if stage.first
             else torch.zeros(1, tokens, m.args.dim, dtype=m.dtype, device=m.device))

        def run() -> None:
            out = stage.compute(x, PROBE_CONTEXT, head=stage.last)
            if stage.last:
                standardize(out, params)
        return run

    reading: dict[str, float] = {}
    for turn in range(stage.count):
        if turn == stage.index:
            reading = RunProbe({"target": forward(1), "target_k8": forward(PROBE_TOKENS)}).take() or {}
        if stage.count > 1:
            dist.barrier()
    return reading


def _first_stage(stage: Stage, exp: ExperimentConfig, *, served: StageServed, requests, tokenizer,  # type: ignore[no-untyped-def]
                 target, params: SamplingParams, draft_slots: int, rows: int, make_verify, make_draft) -> None:
    """Serve the requests (alone, or ``rows`` > 0: several in flight), then the `ar` baseline."""
    from real.errors import RealSetupError as _Err
    from real.model.drafts import ModelDraft

    eos = frozenset() if exp.real.ignore_eos else frozenset(tokenizer.eos_token_ids)
    local = stage.count == 1  # a one-stage pipeline verifies on this process

    def verify_for(req, phase: int):  # type: ignore[no-untyped-def]
        if not local:
            return None
        from real.runtime.links import Kind, Message

        return make_verify(Message(Kind.ACTIVATIONS, request_id=req.request_id, version=phase))

    def serve(flow_of, rec) -> list[list[int]]:  # type: ignore[no-untyped-def]
        if not rows:
            return [run_alone(stage, flow_of(req, 0)) for req in requests]
        from real.runtime.pipelined import serve_pipelined

        return serve_pipelined(stage, exp, requests, flow_of, rec=rec, rows=rows)

    telemetry = Telemetry(exp.real.device)
    with telemetry:
        if spec_of(exp).drafts:  # DSD's windows (real/schedules/decentralized.py)
            # ``target`` holds every weight of the checkpoint (only this stage's layers have a KV
            # cache): an eagle head drafts through its embedding, final norm and LM head
            draft = make_draft(exp, target, tokenizer, draft_params(params, exp.schedule.draft_topk))
            if draft is None:
                raise _Err(f"schedule={exp.schedule.name} needs a draft")
            if isinstance(draft, ModelDraft) and draft.model.max_seq < draft_slots:
                draft.model.setup_cache(draft_slots)
            # the draft's probe, alone: the other stages wait for the first window
            probe = RunProbe(role_probes(None, draft, draft_params(params, exp.schedule.draft_topk)))
            probe.take()
            served.extra.update(probe.fields())
            send = sends_dists(params, draft)
            first_stage = get_schedule(schedule_impl(exp))  # its pipeline flow (real/schedules)
            draft_of = _request_drafts(draft, rows, draft_slots)
            served.outputs = serve(lambda req, row: first_stage(
                stage, draft_of(row), req, eos, exp=exp, rec=stage.rec, send_dists=send,
                verify=verify_for(req, SCHEDULE_PHASE), row=row), stage.rec)
        else:
            served.outputs = serve(lambda req, row: ar_flow(stage, req, eos, verify_for(req, SCHEDULE_PHASE),
                                                            rec=stage.rec, phase=SCHEDULE_PHASE, row=row), stage.rec)
    served.telemetry, served.telemetry_summary = telemetry.frame(), telemetry.summary()
    served.schedule_end_s = stage.now()
    if spec_of(exp).drafts and exp.real.baseline:
        served.baseline = base = RunRecorder(keep_spans=False)
        serve(lambda req, row: ar_flow(stage, req, eos, verify_for(req, BASELINE_PHASE), rec=base, row=row), base)
    stop(stage)


def _request_drafts(draft, rows: int, slots: int):  # type: ignore[no-untyped-def]
    """Each request's draft state by its row: the one draft served alone (row 0); under load a
    draft model's own KV-cache row per request, an eagle head's own row of its cache (and its
    own features, from the last stage's answers), a lookup's own state (real/model/drafts.py)."""
    from real.model.batch import CacheRows
    from real.model.drafts import ModelDraft, NgramDraft, RowModelDraft
    from real.model.eagle import EagleDraft, RowEagleDraft

    if not rows:
        return lambda row: draft
    if isinstance(draft, EagleDraft):
        head_rows = CacheRows(draft.head.body, rows, slots)

        def row_head(row: int) -> RowEagleDraft:
            mine = RowEagleDraft(draft.head, draft.target, draft.params, draft.name, rows=head_rows, row=row)
            mine.record_features = draft.record_features
            return mine
        return row_head
    if isinstance(draft, ModelDraft):
        cache = CacheRows(draft.model, rows, slots)

        def row_draft(row: int) -> RowModelDraft:
            mine = RowModelDraft(draft.model, draft.params, draft.name, rows=cache, row=row)
            mine.record_features = draft.record_features
            return mine
        return row_draft
    if isinstance(draft, NgramDraft):
        return lambda row: NgramDraft(draft.ngram, draft.vocab)
    raise RealSetupError(f"draft {draft.name} cannot serve requests in flight on a pipeline")  # config_validate refuses it


def _nll_per_token(stages: list[StageServed], phase: int, outputs: list[list[int]]) -> float | None:
    last = stages[-1]
    total, n = 0.0, 0
    for rid, out in enumerate(outputs):
        per = last.nll.get((phase, rid), [])[:len(out)]  # tokens past EOS/max_new were not emitted
        total += sum(per)
        n += len(per)
    return total / n if n else None


def summary(exp: ExperimentConfig, stages: list[StageServed], rec: RunRecorder,
            baseline: RunRecorder | None) -> dict[str, Any]:
    """The schedule's summary fields (the simulator's ``decentralized._summary`` with measured
    t0, t1, α and c in place of modelled ones), plus the quality of the outputs."""
    from testbed.theory import dsd_comm_reduction, dsd_speedup

    s = exp.schedule
    first = stages[0]
    outputs = [r["output_ids"] for r in rec.requests]
    out: dict[str, Any] = {**summary_fields(exp),
                           "target_nll_per_token": _nll_per_token(stages, SCHEDULE_PHASE, outputs)}
    if baseline is not None:
        ref = [r["output_ids"] for r in baseline.requests]
        out["baseline_nll_per_token"] = _nll_per_token(stages, BASELINE_PHASE, ref)
        if exp.sampling.temperature == 0:
            out.update({"lossless_reference": "ar baseline (temperature 0)", **divergence(outputs, ref)})
    if not spec_of(exp).drafts:  # `ar` over the pipeline: no windows
        return out
    links = exp.placement.nodes if exp.placement.nodes > 1 else 0
    rounds, _, timeline = rec.frames()
    # the windows' and answers' links (round >= 0): a prompt may wait for a stage still loading
    hops = timeline[(timeline.kind == "link") & (timeline["round"] >= 0)] if len(timeline) else timeline
    t1 = float((hops.end_s - hops.start_s).mean()) if len(hops) else 0.0
    base_rounds = len(baseline.rounds) if baseline is not None else 0
    if base_rounds:  # one 1-token traversal of all stages, measured on the ar baseline
        t0 = sum(st.compute_s.get((BASELINE_PHASE, 1), 0.0) for st in stages) / base_rounds
    else:  # no baseline: a verification traversal (γ+1 tokens) stands in
        t0 = sum(st.compute_s.get((SCHEDULE_PHASE, 1), 0.0) for st in stages) / max(1, len(rounds))
    # a window's traversal (γ+1 tokens): eq. 9 assumes it costs t0, a CPU's does not
    t_window = sum(st.compute_s.get((SCHEDULE_PHASE, 1), 0.0) for st in stages) / max(1, len(rounds))
    k = float((rounds.accepted.sum() + len(rounds)) / len(rounds)) if len(rounds) else float("nan")
    alpha = alpha_from_tokens(k, s.gamma)
    c = float(rounds.draft_s.mean()) / (s.gamma * t0) if len(rounds) and t0 > 0 else float("nan")
    last = stages[-1]
    out.update({
        "adaptive": s.adaptive, "tau": s.tau if s.adaptive else 0.0, "draft_topk": s.draft_topk,
        "t0_ms": 1e3 * t0, "t1_ms": 1e3 * t1, "t_window_ms": 1e3 * t_window, "alpha_measured": alpha, "c_measured": c,
        "tokens_per_round": k,
        "comm_reduction_eq5": dsd_comm_reduction(k, t0, t1, links + 1) if k == k and t0 > 0 else None,
        "key_token_fraction": last.key / last.drafted if s.adaptive and last.drafted else None,
        "theory_speedup": dsd_speedup(alpha, s.gamma, c=c, t0=t0, t1=t1, nodes=links + 1) if c == c else None,
        "theory_speedup_open_chain": dsd_speedup(alpha, s.gamma, c=c, t0=t0, t1=t1, nodes=max(1, links))
        if c == c else None,
        "schedule_end_s": first.schedule_end_s,
    })
    return out


def run_pipeline(exp: ExperimentConfig, placement: Placement) -> RunResult:
    from real.runtime.launch import launch, merge_records

    check(exp)
    results = launch(exp, pipeline_rank, placement=placement)
    if not results:  # torchrun: not rank 0
        return RunResult(recorder=RunRecorder(), baseline=None, extra={"writer": False})
    stages = [r.value for r in sorted(results, key=lambda r: r.value.index)]
    first = stages[0]
    rec = merge_records(results)
    rec.spans = [sp for sp in rec.spans if sp[2] < first.schedule_end_s]  # the baseline's are not the run's
    extra = {"draft": exp.pair.draft.name if spec_of(exp).drafts else None,
             "dtype": real_dtype(exp), "threads": 1, "workload_split": exp.workload.split,
             "max_new_tokens": exp.workload.max_new_tokens, "processes": len(results),
             **summary(exp, stages, rec, first.baseline)}
    extra.pop("schedule_end_s", None)
    # the stages' shares of the target's probe forward, each timed alone (``_probe_stages``)
    for role, name in (("target", "probe_target_s"), ("target_k8", "probe_target_k8_s")):
        extra[name] = round(sum(st.extra.get("probe_stage", {}).get(role, 0.0) for st in stages), 7)
    extra.update({k: v for k, v in first.extra.items() if k in ("probe_draft_s", "probe_draft_k8_s", "probe_draft_pair_s")})
    return RunResult(recorder=rec, baseline=first.baseline, extra=extra,
                     artifacts=run_files(first.telemetry, first.telemetry_summary))


RUNNERS.register(PIPELINE, Runner(run_pipeline, launches_per_run=True))
