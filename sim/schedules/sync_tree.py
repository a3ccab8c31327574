"""`sync` + `schedule.tree=true`: serial tree decoding, SwiftSpec-base (seed 002 §5.1).

Draft and target share all GPUs (placement.draft_gpus / target_gpus, by default the whole node)
and run one after the other. Per round the draft expands its token tree d times (w most probable
leaves per forward; d = ``schedule.tree_depth``, or ``schedule.gamma`` when that is 0 — the
counterpart of sync's γ draft forwards) and at least until the tree holds bs nodes, then the
target verifies the most probable subtree of bs nodes in one forward (testbed.spec.tree_verify)
and the draft re-roots on the verified tokens, keeping the surviving subtree and its KV.
Selecting the subtree is charged in the draft phase and re-rooting (with the KV compaction)
between rounds, as the real backend spends them. Token distributions: sim.oracle.tree_tokens.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from sim.oracle.tree_tokens import TimedTreeDrafter, tree_tokens
from sim.runtime.context import SimContext, SimRequest
from sim.schedules import register
from sim.schedules.sync import prefill_in_turn
from testbed.recorder import RequestRecord


@register("sync_tree")
def sync_tree(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    env, cost, rec, exp = ctx.env, ctx.cost, ctx.rec, ctx.exp
    s = exp.schedule
    depth = s.tree_depth or s.gamma
    drafter = TimedTreeDrafter(ctx, tree_tokens(ctx, req))
    rid = req.request_id
    prefill_s = yield from prefill_in_turn(ctx, req)
    start = env.now
    seq_len = req.prompt_len
    generated, r = 0, 0
    out: list[int] = []
    n_max = req.max_new_tokens
    select_s, reroot_s = cost.tree_round_bookkeeping(drafter.width)  # (real/calibrate/tree.py)
    while generated < n_max:
        t_round = env.now
        draft_s = 0.0
        for _ in range(depth):
            dt = drafter.expand()
            if dt is None:
                break
            draft_s += dt
        draft_s += drafter.fill()
        batch, keys = drafter.select()
        draft_s += select_s
        target_s = cost.tree_forward("target", len(batch), seq_len - 1)
        yield env.timeout(draft_s + target_s)
        res = drafter.toks.verify(batch, keys)
        emitted = min(len(res.tokens), n_max - generated)
        out.extend(res.tokens[:emitted])
        generated += emitted
        seq_len += len(res.tokens)
        rec.round(request_id=rid, round_idx=r, start_s=t_round, end_s=env.now,
                  drafted=len(batch) - 1, checked=res.checked, accepted=res.accepted,
                  emitted=emitted, verified_tokens=len(batch), draft_s=draft_s, target_s=target_s)
        rec.span("draft", "draft", t_round, t_round + draft_s, request_id=rid, round_idx=r)
        rec.span("target", "verify", t_round + draft_s, env.now, request_id=rid, round_idx=r)
        drafter.advance(res.tokens)
        if reroot_s > 0.0:  # between rounds: in the request's decode time, in no round's
            t = env.now
            yield env.timeout(reroot_s)
            rec.span("draft", "reroot", t, env.now, request_id=rid, round_idx=r)
        r += 1
    ids = out if ctx.oracle.produces_ids else []
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=ids, generated=generated, prefill_s=prefill_s, decode_s=env.now - start, rounds=r))
    ctx.extra.update(drafter.summary_fields(), tree_depth_used=depth)
