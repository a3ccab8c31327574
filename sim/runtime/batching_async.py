"""`async` under load in the simulator: SwiftSpec's two groups serving a batch of token trees.

The draft group owns one token tree per request in flight; the target group verifies them. One
round (sim/runtime/batching.py's server admits and prefills between rounds, as for every batched
schedule) is SwiftSpec's Algorithm 1 with every step over the whole batch:

1. the draft fills every tree to ``schedule.tree_budget`` nodes (a new request's from its root):
   expansion j is one tree-masked draft forward over every request that has a j-th;
2. it selects each request's subtree (the bookkeeping one request after another) and sends each
   over the bridge (``sim.schedules.async_tree.bridge_links``; messages queue on the link);
3. the target waits for the round's subtrees, verifies all of them in one batched forward and
   sends each request its verified tokens; meanwhile the draft expands every tree d more times
   (batched as in 1; d from ``AsyncDepth``, which the batch's own round times update, as the
   one-request schedule's do from its rounds);
4. the draft takes the replies and re-roots every tree (bookkeeping one after another).

With one request in flight the steps and their times are those of sim/schedules/async_tree.py.
Both groups run at the same time, so the profile cost model's contention applies to their
forwards as there (its batched tables are for one group alone: tree forwards use the additive
batch model, ``CostModel.batch_forward``).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from sim.oracle.tree_tokens import batched_expansion_seconds
from sim.runtime.context import SimContext
from sim.runtime.pipeline import TOKEN_BYTES
from sim.schedules.async_tree import bridge_links, choose_depth, prefill_both, reply_feature_bytes
from testbed.admission import count_round, span_request
from testbed.links import subtree_message_bytes


def async_prefill(ctx: SimContext, a: Any) -> Generator[Any, Any, None]:
    """One admitted request's prefill on both groups, as one request's (``prefill_both``)."""
    a.prefill_s = yield from prefill_both(ctx, a.req)


def _expansions(ctx: SimContext, grown: Sequence[Sequence[Any]], r: int, rid: int, n: int,
                ) -> Generator[Any, Any, list[float]]:
    """Expansion j of every request that has a j-th (``grown``: each request's expansion
    steps): one batched forward each; returns their seconds."""
    env, cost = ctx.env, ctx.cost
    times = []
    for j in range(max((len(g) for g in grown), default=0)):
        at = [g[j] for g in grown if len(g) > j]
        dt = batched_expansion_seconds(cost, at)
        s0 = env.now
        yield env.timeout(dt)
        ctx.rec.span("draft", "expand", s0, env.now, request_id=rid, round_idx=r, batch=len(at))
        times.append(dt)
    return times


def _bookkeeping(ctx: SimContext, kind: str, dt: float, r: int, rid: int) -> Generator[Any, Any, None]:
    if dt > 0.0:
        s0 = ctx.env.now
        yield ctx.env.timeout(dt)
        ctx.rec.span("draft", kind, s0, ctx.env.now, request_id=rid, round_idx=r)


def async_round(ctx: SimContext, running: list[Any], r: int) -> Generator[Any, Any, None]:
    """One batched round of `async` over ``running`` (sim/runtime/batching.py's ``Active``s,
    each with its ``TimedTreeDrafter``); see the module docstring."""
    env, cost, rec, exp = ctx.env, ctx.cost, ctx.rec, ctx.exp
    to_target, to_draft = bridge_links(ctx)
    if "async_depth" not in ctx.state:
        ctx.state["async_depth"] = choose_depth(ctx, running[0].req, to_target, to_draft)
    ctl = ctx.state["async_depth"][0]
    st = ctx.state.setdefault("async_serving", {"times": []})
    rid, n = span_request(running), len(running)
    select_s, reroot_s = cost.tree_round_bookkeeping(running[0].drafter.width)
    vocab, sampled = exp.pair.target.vocab, exp.sampling.temperature > 0
    feature_bytes = reply_feature_bytes(exp)

    # 1-2. fill every tree, select and send each subtree
    fills = [list(a.drafter.core.fill()) for a in running]
    times = yield from _expansions(ctx, fills, r, rid, n)  # (not d's: only the grow phase's, as the real draft)
    for a, g in zip(running, fills):
        a.draft_s += sum(times[:len(g)])
    picked = []
    for a in running:
        yield from _bookkeeping(ctx, "select", select_s, r, a.req.request_id)
        picked.append(a.drafter.select())
    sent = env.now
    arrivals = [env.process(to_target.send(subtree_message_bytes(b, vocab=vocab, sampled=sampled),
                                           a.req.request_id, r)) for a, (b, _) in zip(running, picked)]
    draft_s = {a.req.request_id: a.draft_s for a in running}

    # 3. the target verifies the batch while the draft grows every tree d more times
    def target() -> Generator[Any, Any, tuple[float, list[Any]]]:
        yield env.all_of(arrivals)
        s0 = env.now
        dt = cost.batch_forward("target", [(len(b), a.seq_len - 1) for a, (b, _) in zip(running, picked)],
                                tree=True)
        yield env.timeout(dt)
        rec.span("target", "verify", s0, env.now, request_id=rid, round_idx=r, batch=n)
        replies = []
        for a, (batch, keys) in zip(running, picked):
            res = a.drafter.toks.verify(batch, keys)
            emitted = min(len(res.tokens), a.req.max_new_tokens - a.generated)
            a.start_s = a.round_start if a.start_s < 0 else a.start_s
            a.out.extend(res.tokens[:emitted])
            a.generated += emitted
            a.seq_len += len(res.tokens)
            rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=a.round_start, end_s=env.now,
                      drafted=len(batch) - 1, checked=res.checked, accepted=res.accepted, emitted=emitted,
                      verified_tokens=len(batch), draft_s=draft_s[a.req.request_id], target_s=dt)
            count_round(a, env.now)
            a.round_start = env.now
            if a.done:
                a.end_s = env.now
            nbytes = TOKEN_BYTES * (len(res.tokens) + 1) + feature_bytes * len(res.tokens)
            replies.append((res.tokens, env.process(to_draft.send(nbytes, a.req.request_id, r))))
        return env.now, replies

    verifying = env.process(target())
    for a in running:
        a.draft_s = 0.0
    grown: list[list[Any]] = [[] for _ in running]
    for _ in range(ctl.next_round()):
        steps = [a.drafter.core.expand() if (not g or g[-1] is not None) else None for a, g in zip(running, grown)]
        for g, step in zip(grown, steps):
            g.append(step)
        live = [[s] for s in steps if s is not None]
        if not live:
            break
        times = yield from _expansions(ctx, live, r + 1, rid, n)
        st["times"] += times
        for a, step in zip(running, steps):
            if step is not None:
                a.draft_s += times[0]
    reply_sent, replies = yield verifying
    yield env.all_of([p for _, p in replies])
    ctl.observe(target_span=reply_sent - sent if r else None, expansions=st["times"])
    st["times"] = []

    # 4. re-root every tree that goes on
    for a, (tokens, _) in zip(running, replies):
        if not a.done:
            a.drafter.advance(tokens)
            yield from _bookkeeping(ctx, "reroot", reroot_s, r, a.req.request_id)
    ctx.extra.update(ctl.summary_fields())
    _, t_target, t_draft = ctx.state["async_depth"]
    ctx.extra.update(t_target_ms=1e3 * t_target, t_draft_ms=1e3 * t_draft)
