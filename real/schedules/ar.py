"""`ar`: the target emits one token per forward (the baseline of every speedup)."""

from __future__ import annotations

from real.runtime.context import RealContext, RealRequest, finish
from real.schedules import register
from testbed.recorder import RequestRecord
from testbed.spec.sampling import sample


@register("ar")
def serve_ar(ctx: RealContext, req: RealRequest) -> None:
    rec, rid, gen = ctx.rec, req.request_id, ctx.generator(req.request_id)
    ids = list(req.prompt_ids)
    s = ctx.now()
    ctx.target.prefill(ids)
    prefill_s = ctx.now() - s
    rec.span("target", "prefill", s, s + prefill_s, request_id=rid)
    start = ctx.now()
    out: list[int] = []
    done, i = False, 0
    while not done:
        s = ctx.now()
        p = ctx.target.probs([ids[-1]], len(ids) - 1)[0]
        t = int(p.argmax()) if ctx.params.greedy else sample(p, gen)
        e = ctx.now()
        ids.append(t)
        out, done = finish(out, [t], req.max_new_tokens, ctx.eos)
        rec.round(request_id=rid, round_idx=i, start_s=s, end_s=e, drafted=0, checked=0, accepted=0,
                  emitted=1, verified_tokens=1, draft_s=0.0, target_s=e - s)
        rec.span("target", "decode", s, e, request_id=rid, round_idx=i)
        ctx.on_tokens(1)
        i += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=prefill_s, decode_s=ctx.now() - start, rounds=i))
