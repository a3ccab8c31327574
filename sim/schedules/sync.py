"""`sync`: Leviathan et al. — the draft proposes γ tokens, the target verifies them in one forward.

Draft and target run one after the other (they may share GPUs). Per round: γ draft forwards
(the first also feeds the tokens the draft has not seen: the previous round's bonus, plus the
last guess when all γ were accepted), then one target forward over γ+1 tokens, then Algorithm 1
(through the oracle, which calls testbed.spec.speculative).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from sim.runtime.context import SimContext, SimRequest
from sim.schedules import register
from testbed.recorder import RequestRecord
from testbed.spec.lookahead import lookahead_for


def next_pending(pending: int, proposed: int, accepted: int, *, forwards: int, dropped: int) -> int:
    """Tokens the draft must feed before its next guess (real/model/drafts.py ``ChainWindow``):
    the bonus, plus the last guess after a fully accepted round unless a dropped guess's forward
    fed it already; a round without a draft forward (γ = 0: speculation off, or a lookup) fed
    nothing, so its token joins the ones still to feed."""
    if forwards == 0:
        return pending + 1
    return 2 if proposed and accepted == proposed and not dropped else 1

def prefill_in_turn(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, float]:
    """A request's prefill where draft and target run one after the other (`sync`, the serial
    tree): the target's, then the draft's. Returns the seconds."""
    env, cost, rec, rid = ctx.env, ctx.cost, ctx.rec, req.request_id
    t0 = env.now
    pf_target = cost.prefill("target", req.prompt_len)
    pf_draft = cost.prefill("draft", req.prompt_len)
    yield env.timeout(pf_target + pf_draft)
    rec.span("target", "prefill", t0, t0 + pf_target, request_id=rid)
    rec.span("draft", "prefill", t0 + pf_target, env.now, request_id=rid)
    return env.now - t0


@register("sync")
def sync(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    env, cost, rec, exp = ctx.env, ctx.cost, ctx.rec, ctx.exp
    seq = ctx.oracle.sequence(req.request_id, req.prompt_len)
    policy = lookahead_for(exp)
    forwards = 0  # draft forwards (an oracle's dropped guess was drafted); none for n-gram
    ngram = exp.pair.draft.kind == "ngram"
    rid = req.request_id
    prefill_s = yield from prefill_in_turn(ctx, req)
    start = env.now
    seq_len = req.prompt_len  # tokens in the sequence; the target has seq_len-1 of them cached
    pending = 1  # tokens the draft must feed before its first guess
    generated, r = 0, 0
    out: list[int] = []
    forward, timeout = cost.forward, env.timeout
    n_max = req.max_new_tokens
    while generated < n_max:
        gamma = policy.next_gamma()
        s = env.now
        # the oracle decides first (it does not depend on time): a replayed n-gram draft may
        # propose fewer than γ guesses, and the forwards below cost what was proposed
        outcome = seq.chain_round(gamma, policy)
        k = gamma if outcome.proposed is None else outcome.proposed
        fw = k + outcome.dropped
        # no draft forward at γ = 0 (speculation off); a lookup looks even when it finds nothing
        draft_s = cost.draft_chain(pending, fw, seq_len) if fw or ngram else 0.0
        forwards += 0 if ngram else fw
        target_s = forward("target", k + 1, seq_len - 1)
        yield timeout(draft_s + target_s)
        n = outcome.accepted
        emitted = min(n + 1, n_max - generated)
        out.extend(outcome.tokens[:emitted])
        generated += emitted
        seq_len += n + 1
        pending = next_pending(pending, k, n, forwards=fw, dropped=outcome.dropped)
        policy.observe(k, n)
        rec.round(request_id=rid, round_idx=r, start_s=s, end_s=env.now, drafted=k,
                  checked=n + (n < k), accepted=n, emitted=emitted, verified_tokens=k + 1,
                  draft_s=draft_s, target_s=target_s)
        rec.span("draft", "draft", s, s + draft_s, request_id=rid, round_idx=r)
        rec.span("target", "verify", s + draft_s, env.now, request_id=rid, round_idx=r)
        r += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=out, generated=generated, prefill_s=prefill_s, decode_s=env.now - start, rounds=r))
    ctx.extra["draft_forwards"] = ctx.extra.get("draft_forwards", 0) + forwards
