"""`async` under load on real models: SwiftSpec's two groups serving a batch of token trees (the
mirror of sim/runtime/batching_async.py).

The draft group's leader is the server: requests arrive on the run clock as ``workload.arrival``
says, wait in testbed/admission.py's FCFS queue and join between rounds. Each request in flight
owns a batch row of the draft's KV cache and of the target's (real/model/batch.py). One round:

1. the draft sends the round's header (``Kind.DATA``: the request ids in batch order, the
   newly admitted last, with their arrival and admission times); both groups prefill the new
   requests into their rows, each on its own devices at the same time;
2. the draft fills every tree to ``schedule.tree_budget`` nodes and selects each subtree (every
   request's ``TreeDrafter`` in a thread of its own, their forwards meeting in batched ones:
   real/runtime/rendezvous.py), then sends one ``Kind.TREE`` message per request;
3. the target verifies every subtree in one batched forward (each request's
   ``TargetTreeTokens`` on its own row, met the same way) and answers each request
   (``Kind.VERIFIED``, ``Kind.STOP`` for its last round); meanwhile the draft expands every
   tree d more times (d: the run's ``AsyncDepth``, fed this batch's round times);
4. the draft re-roots every tree on its answer.

An eagle head drafts too: the draft group keeps a row of the head's KV cache per request and
starts it from the target's prompt features (``Kind.ACTIVATIONS``, sent after each prefill, in
the header's order) instead of prefilling; the head's expansions of every tree meet in one head
forward (real.model.eagle.eagle_rows_tree), and every answer carries the target's features of
the accepted path, as one request's does.

Each request keeps its own drafter, verifier and seeded generators as when served alone, and its
logits in a batch equal its logits alone, so its output equals its one-request `async` output
(at temperature 0: `ar`'s). The target's leader records the rounds and requests (with the
arrival and admission times the header carries); both record spans with the batch size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from real.model.batch import CacheRows
from real.model.eagle import EagleDraft, RowEagleDraft
from real.model.eagle_tree import RowEagleTreeTokens
from real.model.tree_tokens import DraftTreeTokens, TargetTreeTokens, tree_cache_slots
from real.runtime.async_messages import (
    StaleTree,
    pack_batch,
    prompt_features,
    prompt_message,
    reply_message,
    reply_parts,
    unpack_batch,
)
from real.runtime.batching import WallClockArrivals, batch_rows
from real.runtime.context import RealRequest, finish
from real.runtime.links import Kind, Message
from real.runtime.rendezvous import Rendezvous, RowModel
from real.schedules.async_tree import (  # the same streams and messages as one at a time
    DRAFT_SALT,
    TARGET_SALT,
    target_prompt_features,
)
from testbed.admission import Admission, count_round
from testbed.recorder import RequestRecord
from testbed.spec.tree_drafter import AsyncDepth, TreeDrafter

END = -1  # a header's round: no more rounds
BASELINE_DONE = -2  # the target's `ar` baseline under the same load is over
HEARTBEAT = -3  # the sender is still at work (an idle server, the baseline): no receive times out
HEARTBEAT_S = 5.0


@dataclass
class InFlight:
    """One request in flight on either side: its arrival and admission, its KV row, its tokens,
    its place in the batch (a rendezvous's key)."""

    req: RealRequest
    arrival_s: float
    admit_s: float
    row: int
    ids: list[int]
    index: int = 0


@dataclass
class DraftRequest(InFlight):
    """One request in flight on the draft side."""

    drafter: Any = None  # testbed.spec.tree_drafter.TreeDrafter
    prefill_end: float = 0.0
    round: int = 0
    done: bool = False


@dataclass
class TargetRequest(InFlight):
    """One request in flight on the target side."""

    verifier: Any = None  # real.model.tree_tokens.TargetTreeTokens
    prefill_s: float = 0.0
    start_s: float = 0.0
    t_prev: float = 0.0  # its last round's end (the next round's start)
    rounds: int = 0
    first_token_s: float = float("nan")
    out: list[int] = field(default_factory=list)


def _grow(t: DraftRequest, expansions: int | None) -> tuple[int, Any]:
    """``expansions`` more expansions of ``t``'s tree (None: fill it to the budget, then select
    its subtree); (the expansions made, the subtree or None)."""
    made = 0
    while (len(t.drafter.tree) < t.drafter.budget) if expansions is None else made < expansions:
        if t.drafter.expand() is None:
            break
        made += 1
    return made, t.drafter.select() if expansions is None else None


def _per_expansion(seconds: float, grown: list[tuple[int, Any]]) -> list[float]:
    """A phase's batched expansions (as many as the most any request made), each its share."""
    most = max((made for made, _ in grown), default=0)
    return [seconds / most] * most if most else []


@torch.inference_mode()
def draft_server(side: Any, exp: Any, requests: list[RealRequest], depth: AsyncDepth, *,
                 eagle: EagleDraft | None = None) -> None:
    """The draft group's leader under load: arrivals, admission, the rounds (module docstring).
    ``eagle``: an eagle head drafts (its rows of the head's KV cache), from the target's features."""
    s, now, rec = exp.schedule, side.now, side.rec
    longest = max(r.prompt_len + r.max_new_tokens for r in requests)
    rows = CacheRows(side.model if eagle is None else eagle.head.body, batch_rows(exp, len(requests)),
                     tree_cache_slots(longest))
    meet, queue = Rendezvous(), Admission(exp)
    arrivals = WallClockArrivals(exp, requests, queue, now)
    running: list[DraftRequest] = []
    finished, r, draft_s = 0, 0, 0.0
    while finished < len(requests):
        arrivals.poll()
        if not running and not queue.waiting:  # idle until the next arrival; the target waits
            time.sleep(min(HEARTBEAT_S, arrivals.wait_s()))
            side.peer.send(Message(Kind.DATA, round=HEARTBEAT))  # (no receive of it times out)
            continue
        admit_s = now()
        admitted = [DraftRequest(req, arrival_s=t, admit_s=admit_s, row=rows.acquire(), ids=list(req.prompt_ids))
                    for req, t in queue.admit(len(running))]
        running.extend(admitted)
        side.peer.send(Message(Kind.DATA, round=r, version=len(admitted), tensors=(
            torch.tensor([t.req.request_id for t in running], dtype=torch.int64),
            torch.tensor([[t.arrival_s, t.admit_s] for t in admitted], dtype=torch.float64).reshape(-1, 2))))
        for t in admitted:  # while the target prefills them in its own rows
            s0 = now()
            gen = side.generator(t.req.request_id, DRAFT_SALT)
            source: Any
            if eagle is None:
                rows.prefill(t.row, t.ids[:-1])
                source = DraftTreeTokens(RowModel(rows, t.row, meet, lambda t=t: t.index), side.params, t.ids, gen)
            else:  # no prefill here: the head starts from the target's prompt features
                head = RowEagleDraft(eagle.head, eagle.target, eagle.params, eagle.name, rows=rows, row=t.row)
                head.start(t.ids, features=prompt_features(side.peer.recv(), t.req.request_id, len(t.ids)))
                source = RowEagleTreeTokens(head, side.params, t.ids, meet=meet, index=lambda t=t: t.index,
                                            generator=gen)
            t.prefill_end = now()
            rec.span("draft", "prefill", s0, t.prefill_end, request_id=t.req.request_id)
            t.drafter = TreeDrafter(source, width=s.tree_width, budget=s.tree_budget, kv=side.kv, rows=side.rows)
        for i, t in enumerate(running):
            t.index = i
        n = len(running)
        s0 = now()
        filled = meet.run([lambda t=t: _grow(t, None) for t in running])
        batches = [b for _, b in filled]
        fill_s = now() - s0
        rec.span("draft", "expand", s0, now(), request_id=-1 if n > 1 else running[0].req.request_id,
                 round_idx=r, batch=n)
        draft_s += fill_s
        sent = now()
        for t, b in zip(running, batches):
            side.peer.send(Message(Kind.TREE, request_id=t.req.request_id, round=t.round, version=t.round,
                                   committed=len(t.ids), tensors=pack_batch(b, draft_s, t.prefill_end)))
        side.charge("select", now() - sent)
        d = depth.next_round()
        s1 = now()
        grown: list[tuple[int, Any]] = []
        if d:  # grow every tree while the target verifies
            grown = meet.run([lambda t=t, d=d: _grow(t, d) for t in running])
            rec.span("draft", "expand", s1, now(), request_id=-1 if n > 1 else running[0].req.request_id,
                     round_idx=r + 1, batch=n)
        draft_s = now() - s1
        replies = []
        for t in running:
            msg = side.peer.recv()
            if msg.kind not in (Kind.VERIFIED, Kind.STOP) or msg.request_id != t.req.request_id \
                    or msg.version != t.round:
                raise StaleTree(f"draft expected the verified tokens of request {t.req.request_id} round "
                                f"{t.round}, got kind {msg.kind} request {msg.request_id} version {msg.version}")
            replies.append(msg)
        if depth.adaptive:  # per expansion: the batch's forward over every tree
            span = max(m.sent_s for m in replies) - sent if r else None
            # the grow phase's expansions only: the fill's serve the trees short of their budget
            # (often one request's few leaves); counted too, they made an expansion look cheaper
            # than a grow step over every tree and d overshoot the verification (one run of an
            # eagle head at 3 clients: d 3-11, its target waiting ~48 ms of a ~150 ms round)
            depth.observe(target_span=span, expansions=_per_expansion(draft_s, grown))
        s2 = now()
        for t, msg in zip(running, replies):
            if msg.kind == Kind.STOP:
                t.done = True
                continue
            tokens, features = reply_parts(msg)  # (features: an eagle head's, of the accepted path)
            t.drafter.advance(tokens, features=features)  # re-root + KV compaction on its own row
            if len(t.ids) != msg.committed:
                raise StaleTree(f"draft re-rooted after {len(t.ids)} tokens, the target after {msg.committed}")
            t.round += 1
        rec.span("draft", "reroot", s2, now(), request_id=-1 if n > 1 else running[0].req.request_id,
                 round_idx=r, batch=n)
        side.charge("reroot", now() - s2)
        for t in [t for t in running if t.done]:
            running.remove(t)
            rows.release(t.row)
            queue.release(t.req)
            finished += 1
            arrivals.done()
        r += 1
    side.peer.send(Message(Kind.DATA, round=END))


@torch.inference_mode()
def target_server(side: Any, exp: Any, requests: list[RealRequest], eos: frozenset[int], *,
                  slots: int) -> list[list[int]]:
    """The target group under load: each round's header, prefills, one batched verification of
    the round's subtrees, the answers; returns every request's output, in request order."""
    rows = CacheRows(side.model, batch_rows(exp, len(requests)), slots)
    if side.reply_features:  # an eagle head drafts: the prefills' and verifications' hidden states
        side.model.keep_hidden = True
    try:
        return _serve_target(side, exp, requests, eos, rows)
    finally:
        side.model.keep_hidden = False


def _serve_target(side: Any, exp: Any, requests: list[RealRequest], eos: frozenset[int], rows: CacheRows,
                  ) -> list[list[int]]:
    """``target_server``'s rounds."""
    now, rec = side.now, side.rec
    meet = Rendezvous()
    by_id = {r.request_id: r for r in requests}
    live: dict[int, TargetRequest] = {}
    outputs: dict[int, list[int]] = {}
    mode = "topk" if side.params.greedy else "sample"
    while True:
        head = side.peer.recv()
        if head.kind != Kind.DATA or head.round not in (END, HEARTBEAT) and head.round < 0:
            raise StaleTree(f"target expected a round's header, got kind {head.kind} round {head.round}")
        if head.round == HEARTBEAT:
            continue
        if head.round == END:
            break
        order = head.tensors[0].tolist()
        for rid, (arrival, admit) in zip(order[len(order) - head.version:], head.tensors[1].tolist()):
            req = by_id[rid]
            t = TargetRequest(req, arrival_s=arrival, admit_s=admit, row=rows.acquire(), ids=list(req.prompt_ids))
            s0 = now()
            rows.prefill(t.row, t.ids[:-1])
            if side.reply_features:  # the eagle head starts from them
                side.peer.send(prompt_message(rid, len(t.ids), target_prompt_features(side.model, len(t.ids) - 1)))
            t.start_s = t.t_prev = now()
            t.prefill_s = t.start_s - s0
            rec.span("target", "prefill", s0, t.start_s, request_id=rid)
            row = RowModel(rows, t.row, meet, lambda t=t: t.index, features=side.reply_features)
            t.verifier = TargetTreeTokens(row, side.params, side.generator(rid, TARGET_SALT),
                                          features_of=(lambda n, row=row: row.last_hidden[n]) if side.reply_features
                                          else None)
            live[rid] = t
        batch = [live[rid] for rid in order]
        trees = []
        for i, t in enumerate(batch):
            t.index = i
            msg = side.peer.recv()
            if msg.kind != Kind.TREE or msg.request_id != t.req.request_id or msg.version != t.rounds \
                    or msg.committed != len(t.ids):
                raise StaleTree(f"target expected the subtree of request {t.req.request_id} round {t.rounds} "
                                f"rooted after {len(t.ids)} tokens, got kind {msg.kind} request "
                                f"{msg.request_id} version {msg.version} rooted after {msg.committed}")
            trees.append(unpack_batch(msg, mode))
        s0 = now()
        outcomes = meet.run([lambda t=t, b=b: t.verifier.verify(b[0]) for t, b in zip(batch, trees)])
        e = now()
        for t, (tree, draft_s, _), res in zip(batch, trees, outcomes):
            before = len(t.out)
            t.out, done = finish(t.out, res.tokens, t.req.max_new_tokens, eos)
            t.ids.extend(res.tokens)
            side.peer.send(reply_message(t.req.request_id, t.rounds, done=done, committed=len(t.ids),
                                         tokens=res.tokens, features=res.features))
            rec.round(request_id=t.req.request_id, round_idx=t.rounds, start_s=t.t_prev, end_s=e,
                      drafted=len(tree) - 1, checked=res.checked, accepted=res.accepted,
                      emitted=len(t.out) - before, verified_tokens=len(tree), draft_s=draft_s, target_s=e - s0)
            count_round(t, e)
            t.t_prev = e
            if done:
                q = t.req
                rec.request(RequestRecord(
                    request_id=q.request_id, prompt_id=q.prompt_id, prompt_len=q.prompt_len, output_ids=t.out,
                    generated=len(t.out), prefill_s=t.prefill_s, decode_s=e - t.start_s, rounds=t.rounds,
                    arrival_s=t.arrival_s, queue_s=t.admit_s - t.arrival_s, first_token_s=t.first_token_s,
                    finish_s=e))
                outputs[q.request_id] = t.out
                rows.release(t.row)
                del live[q.request_id]
        rec.span("target", "verify", s0, e, request_id=-1 if len(batch) > 1 else batch[0].req.request_id,
                 round_idx=head.round, batch=len(batch))
    return [outputs[r.request_id] for r in requests]


def heartbeat(peer: Any, now: Any) -> Any:
    """An ``on_tokens`` for the target's `ar` baseline under load: a message to the waiting draft
    at most every ``HEARTBEAT_S`` seconds."""
    last = [now()]

    def beat(_: int) -> None:
        if now() - last[0] >= HEARTBEAT_S:
            peer.send(Message(Kind.DATA, round=HEARTBEAT))
            last[0] = now()
    return beat


def wait_for_baseline(peer: Any) -> None:
    """The draft group while the target runs its `ar` baseline under load."""
    while True:
        msg = peer.recv()
        if msg.kind != Kind.DATA or msg.round not in (HEARTBEAT, BASELINE_DONE):
            raise StaleTree(f"draft expected the baseline's messages, got kind {msg.kind} round {msg.round}")
        if msg.round == BASELINE_DONE:
            return
