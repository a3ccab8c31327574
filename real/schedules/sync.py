"""`sync`: Leviathan et al.'s Algorithm 1 — the draft proposes γ guesses, the target verifies
them in one forward over γ+1 tokens and accepts with testbed.spec.speculative.speculative_step,
the same rule the simulator's oracles call (sim/schedules/sync.py)."""

from __future__ import annotations

import torch

from real.model.drafts import NgramDraft
from real.model.generate import oracle_reference
from real.runtime.context import RealContext, RealRequest, finish
from real.schedules import register
from testbed.recorder import RequestRecord
from testbed.spec.lookahead import OracleLookahead, lookahead_for
from testbed.spec.speculative import speculative_step


@register("sync")
def serve_sync(ctx: RealContext, req: RealRequest) -> None:
    assert ctx.draft is not None
    exp, rec, rid, draft = ctx.exp, ctx.rec, req.request_id, ctx.draft
    gen = ctx.generator(req.request_id)
    policy = lookahead_for(exp)
    ids = list(req.prompt_ids)
    if isinstance(policy, OracleLookahead):  # untimed: the target's greedy continuation
        policy.reference = oracle_reference(ctx.target.model, ids, req.max_new_tokens + exp.schedule.gamma, ctx.eos)
    # per-token draft features for the trace: on the splits that feed traces (acceptance=trace
    # replays them: testbed.workloads.TRACE_SOURCE) and whenever the policy reads them
    draft.record_features = policy.needs_features or exp.workload.split in ("calibrate", "trace")
    features = rec.extra_round_columns.setdefault("draft_features", [])
    forwards = 0  # draft forwards (an oracle's dropped guess was drafted); none for n-gram lookups
    s = ctx.now()
    ctx.target.prefill(ids)
    m = ctx.now()
    draft.start(ids)
    prefill_s = ctx.now() - s
    rec.span("target", "prefill", s, m, request_id=rid)
    rec.span("draft", "prefill", m, s + prefill_s, request_id=rid)
    start = ctx.now()
    out: list[int] = []
    done, r = False, 0
    while not done:
        gamma = policy.next_gamma()
        s = ctx.now()
        guesses, q = draft.propose(ids, gamma, gen, policy)
        m = ctx.now()
        p = ctx.target.probs([ids[-1], *guesses], len(ids) - 1)
        step = speculative_step(p, q, draft_tokens=torch.tensor(guesses, dtype=torch.long), generator=gen)
        e = ctx.now()
        n, k = step.accepted, len(guesses)
        ids.extend(step.tokens)
        draft.commit(ids, n, k)
        before = len(out)
        out, done = finish(out, step.tokens, req.max_new_tokens, ctx.eos)
        policy.observe(k, n)
        features.append([x for row in draft.last_features for x in row])
        forwards += 0 if isinstance(draft, NgramDraft) else k + draft.last_dropped
        rec.round(request_id=rid, round_idx=r, start_s=s, end_s=e, drafted=k, checked=n + (n < k),
                  accepted=n, emitted=len(out) - before, verified_tokens=k + 1, draft_s=m - s,
                  target_s=e - m)
        rec.span("draft", "draft", s, m, request_id=rid, round_idx=r)
        rec.span("target", "verify", m, e, request_id=rid, round_idx=r)
        ctx.on_tokens(len(out) - before)
        r += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=prefill_s, decode_s=ctx.now() - start, rounds=r))
    ctx.extra["draft_forwards"] = ctx.extra.get("draft_forwards", 0) + forwards
