"""`sync` + `schedule.tree=true` on real models: serial tree decoding, SwiftSpec-base (seed 002 §5.1).

Draft and target share all devices of the placement (tensor parallel over them) and run one
after the other. Per round the draft expands its token tree d times (w most probable leaves per
forward; d = ``schedule.tree_depth``, or ``schedule.gamma`` when that is 0, as in the
simulator) and at least until the tree holds bs nodes; the target verifies the most probable
subtree of bs nodes in one tree-masked forward (testbed.spec.tree_verify) and the draft
re-roots on the verified tokens, keeping the surviving subtree and its KV.
The drafter is testbed's ``TreeDrafter`` (the simulator's too); distributions and caches come
from real.model.tree_tokens. The simulated twin: sim/schedules/sync_tree.py.
"""

from __future__ import annotations

from real.model.eagle import EagleDraft
from real.model.eagle_tree import EagleTreeTokens
from real.model.tree_tokens import DraftTreeTokens, TargetTreeTokens, tree_cache_slots, tree_models
from real.runtime.context import RealContext, RealRequest, finish
from real.schedules import register
from testbed.recorder import RequestRecord
from testbed.spec.tree_drafter import DraftRowSample, DraftSource, TreeDrafter, TreeKvStats


@register("sync_tree")
def serve_sync_tree(ctx: RealContext, req: RealRequest) -> None:
    exp, rec, rid = ctx.exp, ctx.rec, req.request_id
    s = exp.schedule
    depth = s.tree_depth or s.gamma
    gen = ctx.generator(rid)
    # at temperature 0 a replayed forward's logits stay on the GPU: the leaves are ranked and the
    # verification's argmax taken there, and only those come back (tree_tokens.LocalModel)
    draft_model, target_model = tree_models(ctx, device_logits=ctx.params.greedy)
    ids = list(req.prompt_ids)
    t = ctx.now()
    ctx.target.prefill(ids)
    m = ctx.now()
    ctx.draft.start(ids)
    prefill_s = ctx.now() - t
    rec.span("target", "prefill", t, m, request_id=rid)
    rec.span("draft", "prefill", m, t + prefill_s, request_id=rid)
    kv = ctx.state.setdefault("tree_kv", TreeKvStats())
    rows = ctx.state.setdefault("tree_rows", DraftRowSample())
    if isinstance(ctx.draft, EagleDraft):  # the head reads the target's features
        slots = tree_cache_slots(len(ids) + req.max_new_tokens + s.tree_budget + 2)
        source: DraftSource = EagleTreeTokens(ctx.draft, ctx.params, list(ids), cache_slots=slots, generator=gen)
        hidden = ctx.target.model
        target = TargetTreeTokens(target_model, ctx.params, gen,
                                  features_of=lambda rows: hidden.last_hidden[0, rows])
    else:
        source = DraftTreeTokens(draft_model, ctx.params, list(ids), gen)
        target = TargetTreeTokens(target_model, ctx.params, gen)
    drafter = TreeDrafter(source, width=s.tree_width, budget=s.tree_budget, kv=kv, rows=rows)
    start = ctx.now()
    out: list[int] = []
    done, r = False, 0
    while not done:
        t = ctx.now()
        for _ in range(depth):
            if drafter.expand() is None:
                break
        drafter.fill()
        batch = drafter.select()
        m = ctx.now()
        res = target.verify(batch)
        e = ctx.now()
        before = len(out)
        out, done = finish(out, res.tokens, req.max_new_tokens, ctx.eos)
        drafter.advance(res.tokens, features=res.features)
        rec.span("draft", "reroot", e, ctx.now(), request_id=rid, round_idx=r)
        rec.round(request_id=rid, round_idx=r, start_s=t, end_s=e, drafted=len(batch) - 1,
                  checked=res.checked, accepted=res.accepted, emitted=len(out) - before,
                  verified_tokens=len(batch), draft_s=m - t, target_s=e - m)
        rec.span("draft", "draft", t, m, request_id=rid, round_idx=r)
        rec.span("target", "verify", m, e, request_id=rid, round_idx=r)
        ctx.on_tokens(len(out) - before)
        r += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=prefill_s, decode_s=ctx.now() - start, rounds=r))
    ctx.extra.update(drafter.summary_fields(), tree_depth_used=depth)
