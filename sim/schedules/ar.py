"""`ar`: the target emits one token per forward (the baseline of every speedup).

With ``placement.nodes > 1`` the target is a pipeline over nodes and links (sim.runtime.pipeline): every
token then makes a full round trip (the baseline of `decentralized`)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from sim.runtime.context import SimContext, SimRequest
from sim.schedules import register
from testbed.recorder import RequestRecord


@register("ar")
def ar(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    if ctx.exp.placement.nodes > 1:
        from sim.runtime.pipeline import ar_pipeline

        yield from ar_pipeline(ctx, req)
        return
    env, cost, rec = ctx.env, ctx.cost, ctx.rec
    seq = ctx.oracle.sequence(req.request_id, req.prompt_len)
    rid = req.request_id
    t0 = env.now
    yield env.timeout(cost.prefill("target", req.prompt_len))
    rec.span("target", "prefill", t0, env.now, request_id=rid)
    prefill_s = env.now - t0
    start = env.now
    kv = req.prompt_len - 1  # the last prompt token is fed by the first decode forward
    out: list[int] = []
    forward = cost.forward
    timeout = env.timeout
    for i in range(req.max_new_tokens):
        s = env.now
        dt = forward("target", 1, kv)
        yield timeout(dt)
        out.append(seq.ar_token())
        kv += 1
        rec.round(request_id=rid, round_idx=i, start_s=s, end_s=s + dt, drafted=0, checked=0,
                  accepted=0, emitted=1, verified_tokens=1, draft_s=0.0, target_s=dt)
        rec.span("target", "decode", s, s + dt, request_id=rid, round_idx=i)
    ids = out if ctx.oracle.produces_ids else []
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=ids, generated=len(out), prefill_s=prefill_s, decode_s=env.now - start,
        rounds=req.max_new_tokens))
