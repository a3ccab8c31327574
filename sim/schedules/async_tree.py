"""`async`: SwiftSpec's parallel tree generation (seed 002 §3.1–3.2, Algorithm 1).

The mirror of real/schedules/async_tree.py: the same two module-level worker functions
(``draft_worker``, ``target_worker``) over the same testbed tree drafter and verification; here
they are SimPy processes with modelled time. Two GPU groups of one node, each a SimPy process on its own resource: the draft group
(``placement.draft_gpus`` GPUs, tensor parallel) owns the token tree; the target group
(``placement.target_gpus`` GPUs) verifies. They talk over NVLink (sim.runtime.links: the selected
subtree one way, the verified tokens back). Per iteration:

- target: take the subtree (bs nodes), one forward over it, verify it (greedy path match at
  temperature 0, the lossless multi-candidate rule otherwise: testbed.spec.tree_verify), send
  the emitted tokens back; stop once max_new_tokens are out.
- draft, meanwhile: expand the tree d times (w most probable leaves per forward); then take the
  verified tokens, re-root (DraftTree.reroot: the surviving subtree and its KV slots are kept,
  verified tokens whose KV the draft never computed are fed with its next forward), expand until
  the tree holds at least bs nodes, and send the most probable subtree of size bs. Selecting
  (and packing) the subtree and re-rooting (with the KV compaction) hold the draft group for
  their calibrated times (``cost.tree_round_bookkeeping``, real/calibrate/tree.py): the real
  draft does them on its cores while the target waits for the next subtree.

d: ``testbed.spec.tree_drafter.AsyncDepth`` (``schedule.tree_depth``, or, when 0, as SwiftSpec
sets it from t_target / t_draft), for the first round with t_target = one verification (target
forward over bs tokens plus both NVLink messages) and t_draft = one whole expansion (its forward
and the rest of growing the tree, tree_expand_extra), both modelled at the middle of a request,
each without the other group's contention (the real backend times them one after the other);
for every later round from the modelled times of the rounds done, as the real draft does from
its measured ones (the target's time for a subtree from the draft's sending it to the target's
sending the verified tokens, plus the reply's transfer; the expansions' times).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from sim.cost.quant import spec
from sim.oracle.tree_tokens import TimedTreeDrafter, tree_tokens
from sim.runtime.context import SimContext, SimRequest
from sim.runtime.links import Link
from sim.runtime.pipeline import TOKEN_BYTES, topology_for
from sim.schedules import register
from testbed.links import TREE_NODE_BYTES, TREE_TIMES_BYTES, features_bytes, subtree_message_bytes
from testbed.recorder import RequestRecord
from testbed.spec.tree_drafter import AsyncDepth


def choose_depth(ctx: SimContext, req: SimRequest, to_target: Link, to_draft: Link,
                 ) -> tuple[AsyncDepth, float, float]:
    """(d's controller, t_target, t_draft) — see the module docstring."""
    s, cost = ctx.exp.schedule, ctx.cost
    ref = req.prompt_len + req.max_new_tokens // 2
    bs, w = s.tree_budget, s.tree_width
    # each forward alone, as the real backend times them (one after the other, at the start)
    reply_s = to_draft.transfer_time(TOKEN_BYTES * (bs + 1))
    # (a subtree's rows: the real probe's one-way time is that of a small message too)
    t_target = (cost.tree_forward("target", bs, ref, alone=True)
                + to_target.transfer_time(TREE_NODE_BYTES * bs + TREE_TIMES_BYTES) + reply_s)
    # one whole expansion, as TimedTreeDrafter charges it (the real backend times expand()).
    # The real probe's tree grows after the prompt and copies of its last token: there an
    # n-gram draft finds one continuation per lookup, and every timed expansion has one leaf
    # (real t_draft 0.2-0.9 ms, d at its cap; with w leaves charged here, d came out 47 where
    # the real runs chose 64, and the simulated draft kept pace where the real one fell behind)
    leaves = 1 if ctx.exp.pair.draft.kind == "ngram" else w
    t_draft = cost.tree_forward("draft", leaves, ref, alone=True) + cost.tree_expand_extra(leaves)
    return (AsyncDepth(tree_depth=s.tree_depth, t_target=t_target, t_draft=t_draft, reply_s=reply_s),
            t_target, t_draft)


def bridge_links(ctx: SimContext) -> tuple[Link, Link]:
    """(draft -> target, target -> draft): the topology's links (the hardware's NVLink figures),
    or, where the profile cost model has measured this host's bridge (`ProfileCost.bridge_link`:
    the testbed's transport with the sender computing), links with those figures — one pair per
    simulation, as the topology's."""
    links = ctx.state.get("bridge_links")
    if links is None:
        topo = topology_for(ctx)
        links = (topo.link("draft", "target"), topo.link("target", "draft"))
        measured = getattr(ctx.cost, "bridge_link", None)
        models = [measured(lk.name) for lk in links] if measured is not None else [None, None]
        if all(m is not None for m in models):
            links = tuple(Link.of(ctx.env, m, ctx.exp.seed, lk.rec) for m, lk in zip(models, links))
        ctx.state["bridge_links"] = links
    return links


class Peer:
    """The other group as one side sees it: what this side sends crosses the link (modelled
    transfer time) into the peer's inbox; ``recv`` is the event of this side's next message."""

    def __init__(self, env: simpy.Environment, link: Link, inbox: simpy.Store,
                 peer_inbox: simpy.Store) -> None:
        self.env, self.link, self.inbox, self.peer_inbox = env, link, inbox, peer_inbox

    def send(self, nbytes: int, item: Any, request_id: int, r: int) -> None:
        self.env.process(self._deliver(nbytes, item, request_id, r))

    def _deliver(self, nbytes: int, item: Any, request_id: int, r: int) -> Generator[Any, Any, None]:
        yield from self.link.send(nbytes, request_id, r)
        self.peer_inbox.put(item)

    def recv(self) -> simpy.events.Event:
        return self.inbox.get()


@dataclass
class Side:
    """One group's half of the schedule: the clock, its cost model, its device group (a SimPy
    resource), its view of the peer group, the recorder."""

    env: simpy.Environment
    cost: Any  # sim.cost.base.CostModel
    group: simpy.Resource
    peer: Peer
    rec: Any  # testbed.recorder.RunRecorder
    vocab: int = 0  # the pair's vocabulary (the draft's q rows in a subtree message at T > 0)
    sampled: bool = False  # temperature > 0: subtrees carry q
    feature_bytes: int = 0  # per verified token in the target's reply (an eagle draft reads them)

    def now(self) -> float:
        return self.env.now


def target_worker(side: Side, req: SimRequest, toks: Any, start: float, *, out: list[int],
                  finished: dict[str, float]) -> Generator[Any, Any, None]:
    """SwiftSpec Algorithm 1, target side, for one request: verify each subtree the draft
    sends, send back the emitted tokens; records the rounds."""
    env, rec, rid, n_max = side.env, side.rec, req.request_id, req.max_new_tokens
    seq_len, generated, r, t_prev = req.prompt_len, 0, 0, start
    while True:
        batch, keys, draft_s = yield side.peer.recv()
        with side.group.request() as hold:
            yield hold
            s0 = env.now
            dt = side.cost.tree_forward("target", len(batch), seq_len - 1)
            yield env.timeout(dt)
        rec.span("target", "verify", s0, env.now, request_id=rid, round_idx=r)
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
        reply = TOKEN_BYTES * (len(res.tokens) + 1) + side.feature_bytes * len(res.tokens)
        side.peer.send(reply, (res.tokens, done, env.now), rid, r)
        r += 1
        if done:
            finished.update(end=env.now, rounds=r)
            return


def draft_worker(side: Side, req: SimRequest, drafter: TimedTreeDrafter, depth: AsyncDepth,
                 ) -> Generator[Any, Any, None]:
    """SwiftSpec Algorithm 1, draft side, for one request: grow the tree, send the best subtree
    of ``budget`` nodes, grow d more times while the target verifies (d: the run's
    ``AsyncDepth``, which the rounds' times update), re-root on the verified tokens; until the
    target says the request is done."""
    env, rec, rid, ctl = side.env, side.rec, req.request_id, depth
    tree = drafter.tree

    def expand(r: int) -> Generator[Any, Any, float | None]:
        dt = drafter.expand()
        if dt is None:
            return None
        with side.group.request() as hold:
            yield hold
            s0 = env.now
            yield env.timeout(dt)
        rec.span("draft", "expand", s0, env.now, request_id=rid, round_idx=r)
        return dt

    def bookkeeping(kind: str, dt: float, r: int) -> Generator[Any, Any, None]:
        if dt <= 0.0:
            return
        with side.group.request() as hold:
            yield hold
            s0 = env.now
            yield env.timeout(dt)
        rec.span("draft", kind, s0, env.now, request_id=rid, round_idx=r)

    select_s, reroot_s = side.cost.tree_round_bookkeeping(drafter.width)
    vocab, sampled = side.vocab, side.sampled
    def fill(r: int) -> Generator[Any, Any, float]:
        """Expand until the tree holds its budget (or has no leaf left); the seconds spent."""
        spent = 0.0
        while len(tree) < drafter.budget:
            dt = yield from expand(r)
            if dt is None:
                break
            spent += dt
            times.append(dt)
        return spent

    r, times = 0, []  # times: expansions since d was last updated
    draft_s = yield from fill(r)
    while True:
        yield from bookkeeping("select", select_s, r)
        batch, keys = drafter.select()
        sent = env.now
        side.peer.send(subtree_message_bytes(batch, vocab=vocab, sampled=sampled), (batch, keys, draft_s), rid, r)
        draft_s = 0.0
        for _ in range(ctl.next_round()):  # grow while the target verifies
            dt = yield from expand(r + 1)
            if dt is None:
                break
            draft_s += dt
            times.append(dt)
        tokens, done, reply_sent = yield side.peer.recv()
        # (round 0's subtree may wait for the target's prefill: no target time, as the real draft)
        ctl.observe(target_span=reply_sent - sent if r else None, expansions=times)
        times = []
        if done:
            return
        drafter.advance(tokens)  # re-root + KV compaction
        yield from bookkeeping("reroot", reroot_s, r)
        r += 1
        draft_s += yield from fill(r)


def reply_feature_bytes(exp: Any) -> int:
    """Bytes per verified token that the target adds to its reply: the token's last hidden state
    when the draft is a feature-level (eagle) head, else none."""
    t = exp.pair.target
    return features_bytes(1, hidden=t.hidden, act_bytes=spec(t.quant).act_bytes) \
        if exp.pair.draft.kind == "eagle" else 0


def prefill_both(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, float]:
    """A request's prefill on both groups, at once; an eagle head instead reads the target's
    features of the prompt: the target prefills, sends them (real/runtime/async_messages.py:
    Kind.ACTIVATIONS), then the head feeds its prompt pairs. Returns the seconds."""
    env, cost, rec, rid = ctx.env, ctx.cost, ctx.rec, req.request_id
    t0 = env.now
    pf_target, pf_draft = cost.prefill("target", req.prompt_len), cost.prefill("draft", req.prompt_len)
    if ctx.exp.pair.draft.kind == "eagle":
        yield env.timeout(pf_target)
        rec.span("target", "prefill", t0, env.now, request_id=rid)
        t = ctx.exp.pair.target
        _, to_draft = bridge_links(ctx)
        yield from to_draft.send(features_bytes(req.prompt_len - 1, hidden=t.hidden,
                                                act_bytes=spec(t.quant).act_bytes), rid)
        t_features = env.now
        yield env.timeout(pf_draft)
        rec.span("draft", "prefill", t_features, env.now, request_id=rid)
    else:
        yield env.timeout(max(pf_target, pf_draft))
        rec.span("target", "prefill", t0, t0 + pf_target, request_id=rid)
        rec.span("draft", "prefill", t0, t0 + pf_draft, request_id=rid)
    return env.now - t0


@register("async")
def async_tree(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    env, cost, rec = ctx.env, ctx.cost, ctx.rec
    to_target, to_draft = bridge_links(ctx)
    groups = ctx.state.setdefault("groups", {"draft": simpy.Resource(env, 1),
                                             "target": simpy.Resource(env, 1)})
    if "async_depth" not in ctx.state:
        ctx.state["async_depth"] = choose_depth(ctx, req, to_target, to_draft)
    depth, t_target, t_draft = ctx.state["async_depth"]
    drafter = TimedTreeDrafter(ctx, tree_tokens(ctx, req))
    rid = req.request_id

    prefill_s = yield from prefill_both(ctx, req)
    start = env.now
    target_inbox, draft_inbox = simpy.Store(env), simpy.Store(env)
    target_side = Side(env, cost, groups["target"], Peer(env, to_draft, target_inbox, draft_inbox), rec,
                       feature_bytes=reply_feature_bytes(ctx.exp))
    draft_side = Side(env, cost, groups["draft"], Peer(env, to_target, draft_inbox, target_inbox), rec,
                      vocab=ctx.exp.pair.target.vocab, sampled=ctx.exp.sampling.temperature > 0)
    out: list[int] = []
    finished: dict[str, float] = {}
    target = env.process(target_worker(target_side, req, drafter.toks, start, out=out, finished=finished))
    yield from draft_worker(draft_side, req, drafter, depth)
    yield target
    ids = out if ctx.oracle.produces_ids else []
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=ids, generated=len(out), prefill_s=prefill_s, decode_s=finished["end"] - start,
        rounds=int(finished["rounds"])))
    ctx.extra.update(drafter.summary_fields(), **depth.summary_fields(),
                     t_target_ms=1e3 * t_target, t_draft_ms=1e3 * t_draft)
    if hasattr(cost, "contention_factor"):  # sim.cost.profile: the groups slow each other down
        sched = ctx.exp.schedule
        ctx.extra.update(contention_target=cost.contention_factor("target", sched.tree_budget),
                         contention_draft=cost.contention_factor("draft", sched.tree_width))
