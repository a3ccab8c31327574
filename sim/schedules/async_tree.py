"""`async`: SwiftSpec's parallel tree generation (seed 002 §3.1–3.2, Algorithm 1).

Two GPU groups of one node, each a SimPy process on its own resource: the draft group
(``placement.draft_gpus`` GPUs, tensor parallel) owns the token tree; the target group
(``placement.target_gpus`` GPUs) verifies. They talk over NVLink (sim.links: the selected
subtree one way, the verified tokens back). Per iteration:

- target: take the subtree (bs nodes), one forward over it, verify it (greedy path match at
  temperature 0, the lossless multi-candidate rule otherwise: testbed.spec.tree_verify), send
  the emitted tokens back; stop once max_new_tokens are out.
- draft, meanwhile: expand the tree d times (w most probable leaves per forward); then take the
  verified tokens, re-root (DraftTree.reroot: the surviving subtree and its KV slots are kept,
  verified tokens whose KV the draft never computed are fed with its next forward), expand until
  the tree holds at least bs nodes, and send the most probable subtree of size bs.

d: ``schedule.tree_depth``, or, when 0, as SwiftSpec sets it: with t_target = one verification
(target forward over bs tokens plus both NVLink messages) and t_draft = one expansion forward,
both modelled at the middle of a request, r = floor(t_target / t_draft) and d = r or r+1,
whichever makes the d expansions end closest to the verification (d = floor(r_exact + 1/2)),
at least 1 and at most 64.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import simpy

from sim.context import SimContext, SimRequest
from sim.links import Link
from sim.pipeline import TOKEN_BYTES, topology_for
from sim.schedules import register
from sim.tree_tokens import BATCH_BYTES_PER_NODE, TimedTreeDrafter, tree_tokens

MAX_DEPTH = 64


def choose_depth(ctx: SimContext, req: SimRequest, to_target: Link, to_draft: Link,
                 ) -> tuple[int, float, float]:
    """(d, t_target, t_draft) — see the module docstring."""
    s, cost = ctx.exp.schedule, ctx.cost
    ref = req.prompt_len + req.max_new_tokens // 2
    bs, w = s.tree_budget, s.tree_width
    t_target = (cost.tree_forward("target", bs, ref) + to_target.transfer_time(BATCH_BYTES_PER_NODE * bs)
                + to_draft.transfer_time(TOKEN_BYTES * (bs + 1)))
    t_draft = cost.tree_forward("draft", w, ref)
    if s.tree_depth > 0:
        return s.tree_depth, t_target, t_draft
    ratio = t_target / t_draft if t_draft > 0 else float(MAX_DEPTH)
    return min(MAX_DEPTH, max(1, math.floor(ratio + 0.5))), t_target, t_draft


@register("async")
def async_tree(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    env, cost, rec = ctx.env, ctx.cost, ctx.rec
    topo = topology_for(ctx)
    to_target, to_draft = topo.link("draft", "target"), topo.link("target", "draft")
    groups = ctx.state.setdefault("groups", {"draft": simpy.Resource(env, 1),
                                             "target": simpy.Resource(env, 1)})
    if "async_depth" not in ctx.state:
        ctx.state["async_depth"] = choose_depth(ctx, req, to_target, to_draft)
    depth, t_target, t_draft = ctx.state["async_depth"]
    drafter = TimedTreeDrafter(ctx, tree_tokens(ctx, req))
    tree, toks = drafter.tree, drafter.toks
    rid, n_max = req.request_id, req.max_new_tokens

    # prefill on both groups at once
    t0 = env.now
    pf_target, pf_draft = cost.prefill("target", req.prompt_len), cost.prefill("draft", req.prompt_len)
    yield env.timeout(max(pf_target, pf_draft))
    rec.span("target", "prefill", t0, t0 + pf_target, rid)
    rec.span("draft", "prefill", t0, t0 + pf_draft, rid)
    prefill_s = env.now - t0
    start = env.now
    target_inbox, draft_inbox = simpy.Store(env), simpy.Store(env)
    out: list[int] = []
    finished: dict[str, float] = {}

    def deliver(link: Link, nbytes: int, inbox: simpy.Store, item: Any, r: int,
                ) -> Generator[Any, Any, None]:
        yield from link.send(nbytes, rid, r)
        inbox.put(item)

    def target_worker() -> Generator[Any, Any, None]:
        seq_len, generated, r, t_prev = req.prompt_len, 0, 0, start
        while True:
            batch, keys, draft_s = yield target_inbox.get()
            with groups["target"].request() as hold:
                yield hold
                s0 = env.now
                dt = cost.tree_forward("target", len(batch), seq_len - 1)
                yield env.timeout(dt)
            rec.span("target", "verify", s0, env.now, rid, r)
            res = toks.verify(batch, keys)
            emitted = min(len(res.tokens), n_max - generated)
            out.extend(res.tokens[:emitted])
            generated += emitted
            seq_len += len(res.tokens)
            rec.round(request_id=rid, round_idx=r, start_s=t_prev, end_s=env.now,
                      drafted=len(batch) - 1, checked=res.checked, accepted=res.accepted,
                      emitted=emitted, verified_tokens=len(batch), draft_s=draft_s, target_s=dt)
            t_prev = env.now
            done = generated >= n_max
            env.process(deliver(to_draft, TOKEN_BYTES * (len(res.tokens) + 1), draft_inbox,
                                (res.tokens, done), r))
            r += 1
            if done:
                finished.update(end=env.now, rounds=r)
                return

    target = env.process(target_worker())

    def expand(r: int) -> Generator[Any, Any, float | None]:
        dt = drafter.expand()
        if dt is None:
            return None
        with groups["draft"].request() as hold:
            yield hold
            s0 = env.now
            yield env.timeout(dt)
        rec.span("draft", "expand", s0, env.now, rid, r)
        return dt

    # the draft worker: SwiftSpec Algorithm 1, draft side
    r, draft_s = 0, 0.0
    while len(tree) < drafter.budget:
        dt = yield from expand(r)
        if dt is None:
            break
        draft_s += dt
    while True:
        batch, keys = drafter.select()
        env.process(deliver(to_target, BATCH_BYTES_PER_NODE * len(batch), target_inbox,
                            (batch, keys, draft_s), r))
        draft_s = 0.0
        for _ in range(depth):  # grow while the target verifies
            dt = yield from expand(r + 1)
            if dt is None:
                break
            draft_s += dt
        tokens, done = yield draft_inbox.get()
        if done:
            break
        drafter.advance(tokens)
        r += 1
        while len(tree) < drafter.budget:
            dt = yield from expand(r)
            if dt is None:
                break
            draft_s += dt
    yield target
    ids = out if ctx.oracle.produces_ids else []
    rec.request(rid, req.prompt_id, req.prompt_len, ids, len(out), prefill_s,
                finished["end"] - start, int(finished["rounds"]))
    ctx.extra.update(drafter.summary_fields(), tree_depth_used=depth,
                     t_target_ms=1e3 * t_target, t_draft_ms=1e3 * t_draft)
