"""Serving under load on the real backend: arrivals on the wall clock, admission and continuous
batching (the mirror of sim/runtime/batching.py).

Requests arrive as ``workload.arrival`` says (testbed/arrivals.py: a closed loop of clients,
seeded Poisson arrivals, a trace), wait in the FCFS queue of testbed/admission.py and join the
batch between rounds within ``serving.max_batch`` and ``serving.kv_budget_tokens``. Every request
in flight owns a batch row of the target's KV cache (and of the draft's): one cache with a batch
dimension, indexed by slot as at batch 1 (real/model/batch.py; why not paged: a row costs
``max_seq`` slots whether used or not, and at this testbed's batch sizes and contexts the rows
of the bundled pair take tens of MB, while a page table would put an indirection into every
attention read of the native kernels). Newly admitted requests are prefilled first, one after
the other (the batch waits), then one round serves every running request:

- ``ar``: one target forward over every request's next token;
- ``sync``: each request's lookahead policy picks its γ, the draft runs every request's chain
  window as batched steps (step j feeds every request still drafting; an early-exit draft runs
  the target's first layers on the request's own cache row; an eagle head its layer on the
  request's row of its own cache, the LM head once for all), then one target forward
  verifies every request's window and each request accepts with
  testbed.spec.speculative.speculative_step, drawing from its own generator (an eagle head
  then takes the target's features of the accepted tokens from that forward);
- ``sync`` with ``schedule.tree=true`` (the serial tree): every request's tree is expanded d times
  and filled (expansion j of every request in one batched draft forward: real/runtime/rendezvous.py
  runs each request's drafter in a thread of its own and meets their forwards), every subtree is
  verified in one batched target forward, then each request re-roots on its own rows (an eagle
  head's tree: its expansions are one head forward over the requests' rows, and it takes the
  target's features of the accepted path from the batched verification).

A request's logits in a batch equal its logits served alone (real/model/batch.py), and it draws
from its own seeded generator in the same order, so each request's output under load equals its
output served alone, at any temperature. Recorded as in the simulator: requests.parquet with
arrival, queueing, first and last token; a rounds.parquet row per round and request (the batch's
draft and target times); timeline spans with the batch size.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from real.model.batch import CacheRows, Feed, forward_batch, forward_batch_features
from real.model.drafts import ChainWindow, Draft, EarlyExitDraft, ModelDraft, NgramDraft
from real.model.eagle import EagleDraft, RowEagleDraft, eagle_rows_logits
from real.model.eagle_tree import RowEagleTreeTokens
from real.model.tree_tokens import DraftTreeTokens, TargetTreeTokens, tree_cache_slots
from real.runtime.context import RealContext, RealRequest, finish
from real.runtime.rendezvous import Rendezvous, RowModel
from testbed.admission import Admission, count_round, span_request
from testbed.arrivals import arrival_times
from testbed.recorder import RequestRecord
from testbed.schedules import spec_of
from testbed.spec.lookahead import OracleLookahead, lookahead_for
from testbed.spec.sampling import sample, standardize
from testbed.spec.speculative import speculative_step
from testbed.spec.tree_drafter import DraftRowSample, DraftSource, TreeDrafter, TreeKvStats


@dataclass
class Active:
    """One admitted request's state between rounds."""

    req: RealRequest
    arrival_s: float
    admit_s: float
    row: int
    gen: torch.Generator
    ids: list[int]
    draft: Draft | None = None  # its own draft state (sharing the draft's model)
    draft_row: int = 0
    policy: Any = None
    drafter: Any = None  # the serial tree: its testbed.spec.tree_drafter.TreeDrafter
    verifier: Any = None  # and its real.model.tree_tokens.TargetTreeTokens
    index: int = 0  # its place in the running batch (a rendezvous's key)
    prefill_s: float = 0.0
    start_s: float = -1.0
    first_token_s: float = float("nan")
    rounds: int = 0
    out: list[int] = field(default_factory=list)
    done: bool = False


class WallClockArrivals:
    """The run's requests arriving into ``queue`` on the wall clock (``now``): a closed loop's
    first clients at once and each next one when a request is done (``done``), or each at its
    arrival time (``poll``; ``wait_s``: how long until the next)."""

    def __init__(self, exp: Any, requests: list[RealRequest], queue: Admission, now: Callable[[], float]) -> None:
        self.queue, self.now = queue, now
        t0 = now()
        offsets = arrival_times(exp, len(requests))
        self.closed = offsets is None
        self.unsent = deque(requests)
        self.timed = deque(t0 + t for t in offsets) if offsets is not None else deque()
        if self.closed:
            for _ in range(min(exp.workload.concurrency, len(self.unsent))):
                queue.arrive(self.unsent.popleft(), t0)

    def poll(self) -> None:
        while self.timed and self.unsent and self.timed[0] <= self.now():
            self.queue.arrive(self.unsent.popleft(), self.timed.popleft())

    def wait_s(self) -> float:
        return max(0.0, self.timed[0] - self.now()) if self.timed else 0.0

    def done(self) -> None:
        if self.closed and self.unsent:
            self.queue.arrive(self.unsent.popleft(), self.now())


def batch_rows(exp: Any, n_requests: int) -> int:
    """Requests that can be in flight at once: the KV-cache rows to allocate."""
    w, cap = exp.workload, exp.serving.max_batch or n_requests
    most = min(w.concurrency, n_requests) if w.arrival == "closed" else n_requests
    return max(1, min(cap, most))


@torch.inference_mode()
def serve_batched(ctx: RealContext, requests: list[RealRequest], *, max_seq: int, group: Any = None) -> None:
    """Serve ``requests`` under the run's load until every one is answered; ``group``: the
    tensor-parallel group this rank serves in (its leader admits, ``_admissions``)."""
    exp = ctx.exp
    target = ctx.target.model
    references = _oracle_references(ctx, requests)  # before the clock starts and the rows exist
    rows = batch_rows(exp, len(requests))
    target_rows = CacheRows(target, rows, max_seq)
    draft_model = ctx.draft.model if isinstance(ctx.draft, ModelDraft) else None
    tree = ctx.draft is not None and spec_of(exp).tree  # (its `ar` baseline keeps the experiment)
    longest = max(r.prompt_len + r.max_new_tokens for r in requests)
    draft_slots = tree_cache_slots(longest) if tree else max_seq  # a tree's slots beyond the sequence
    draft_rows = CacheRows(draft_model, rows, draft_slots) if draft_model is not None else None
    if isinstance(ctx.draft, EagleDraft):  # the head's own KV cache, a row per request
        draft_rows = CacheRows(ctx.draft.head.body, rows, draft_slots)
    meet = Rendezvous() if tree else None
    # on a GPU: capture the batched chains' CUDA graphs before the timed rounds (real/model/batch_graphs.py)
    window = range(1, min(exp.schedule.gamma + 1, 16) + 1) if ctx.draft is not None and not tree else [1]
    for model, counts in ((target, window), (draft_model, [1, 2])):
        if model is not None and model.graph_batches is not None:
            model.graph_batches.prepare(rows, list(counts))
    queue = Admission(exp)
    arrivals = WallClockArrivals(exp, requests, queue, ctx.now)
    running: list[Active] = []
    finished, r = 0, 0
    by_id = {r.request_id: r for r in requests}
    while finished < len(requests):
        now, taken = _admissions(ctx, arrivals, queue, len(running), group=group, by_id=by_id)
        # admitted together, then prefilled one after the other
        admitted = [_admit(ctx, req, arrived=t, admitted=now, target_rows=target_rows, draft_rows=draft_rows,
                           reference=references.get(req.request_id)) for req, t in taken]
        if meet is not None:
            for a in admitted:
                _grow_tree(ctx, a, meet, target_rows=target_rows, draft_rows=draft_rows)
        running.extend(admitted)
        if not running:
            continue
        if ctx.draft is None:
            _ar_round(ctx, running, r)
        elif meet is not None:
            _tree_round(ctx, running, r, meet)
        else:
            _sync_round(ctx, running, r, draft_model)
        r += 1
        for a in [a for a in running if a.done]:
            running.remove(a)
            queue.release(a.req)
            target_rows.release(a.row)
            if draft_rows is not None:
                draft_rows.release(a.draft_row)
            finished += 1
            _record(ctx, a)
            arrivals.done()


def _admissions(ctx: RealContext, arrivals: WallClockArrivals, queue: Admission, running: int, *,
                group: Any, by_id: dict[int, RealRequest]) -> tuple[float, list[tuple[RealRequest, float]]]:
    """(now, the requests admitted now with their arrival times), after waiting for one when
    none runs or waits. In a tensor-parallel group the leader decides and sends the decision to
    the other ranks, so that every rank serves the same rounds (and enters the same collectives)."""
    leader = group is None or dist.get_rank(group) == 0
    now, taken = 0.0, []
    if leader:
        arrivals.poll()
        while not running and not queue.waiting:
            time.sleep(arrivals.wait_s())  # idle until the next arrival
            arrivals.poll()
        now = ctx.now()
        taken = queue.admit(running)
    if group is not None:
        box: list[Any] = [(now, [(req.request_id, t) for req, t in taken])] if leader else [None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        now, ids = box[0]
        taken = [(by_id[i], t) for i, t in ids]
    return now, taken  # type: ignore[return-value]


def _oracle_references(ctx: RealContext, requests: list[RealRequest]) -> dict[int, list[int]]:
    """The oracle policy's reference of every request, generated one request after another
    before serving starts: under load they cannot be generated beside the wall clock. Empty for
    every other policy."""
    if ctx.draft is None or not isinstance(lookahead_for(ctx.exp), OracleLookahead):
        return {}
    from real.model.generate import oracle_reference

    return {req.request_id: oracle_reference(ctx.target.model, req.prompt_ids,
                                             req.max_new_tokens + ctx.exp.schedule.gamma, ctx.eos)
            for req in requests}


def _admit(ctx: RealContext, req: RealRequest, *, arrived: float, admitted: float,
           target_rows: CacheRows, draft_rows: CacheRows | None, reference: list[int] | None = None) -> Active:
    """Prefill a request into its own cache rows (one request at a time, the batch waiting);
    ``reference``: the oracle policy's (``_oracle_references``)."""
    rid, ids = req.request_id, list(req.prompt_ids)
    a = Active(req, arrival_s=arrived, admit_s=admitted, row=target_rows.acquire(),
               gen=ctx.generator(rid), ids=ids)
    s = ctx.now()
    target_rows.prefill(a.row, ids[:-1])
    m = ctx.now()
    ctx.rec.span("target", "prefill", s, m, request_id=rid)
    if ctx.draft is not None:
        a.policy = lookahead_for(ctx.exp)
        if isinstance(a.policy, OracleLookahead):
            assert reference is not None, "the oracle policy needs its reference (_oracle_references)"
            a.policy.reference = reference
        if isinstance(ctx.draft, EagleDraft):  # its row of the head's cache
            assert draft_rows is not None
            a.draft_row = draft_rows.acquire()
            a.draft = RowEagleDraft(ctx.draft.head, ctx.draft.target, ctx.draft.params, ctx.draft.name,
                                    rows=draft_rows, row=a.draft_row)
        else:
            a.draft = _request_draft(ctx.draft)
        # as real/schedules/sync.py: the trace runs record what per-token policies replay
        a.draft.record_features = a.policy.needs_features or ctx.exp.workload.split in ("calibrate", "trace")
        if isinstance(a.draft, EarlyExitDraft):  # the target's prefill filled its layers' slots
            a.draft.cached = len(ids) - 1
        if isinstance(a.draft, RowEagleDraft):
            a.draft.start(ids)  # the features of the prefill that just ran
        elif draft_rows is not None:
            a.draft_row = draft_rows.acquire()
            draft_rows.prefill(a.draft_row, ids[:-1])
            a.draft.cached = len(ids) - 1
            ctx.rec.span("draft", "prefill", m, ctx.now(), request_id=rid)
    a.prefill_s = ctx.now() - s
    return a


def _request_draft(draft: Draft) -> Draft:
    """A request's own draft state: its cache position and last window (the model is shared)."""
    if isinstance(draft, ModelDraft):
        mine: Draft = ModelDraft(draft.model, draft.params, draft.name)
    elif isinstance(draft, EarlyExitDraft):
        mine = EarlyExitDraft(draft.target, draft.exit_layer, draft.params)
    elif isinstance(draft, NgramDraft):
        mine = NgramDraft(draft.ngram, draft.vocab)
    else:  # testbed.config_validate refuses the others under load
        raise TypeError(f"draft {draft.name} cannot serve batched rounds")
    mine.record_features = draft.record_features
    return mine


def _ar_round(ctx: RealContext, running: list[Active], r: int) -> None:
    s = ctx.now()
    logits = forward_batch(ctx.target.model, [Feed(a.row, [a.ids[-1]], len(a.ids) - 1) for a in running])
    tokens = []
    for a, lg in zip(running, logits):
        p = standardize(lg, ctx.params)[0]
        tokens.append(int(p.argmax()) if ctx.params.greedy else sample(p, a.gen))
    e = ctx.now()
    for a, t in zip(running, tokens):
        a.start_s = s if a.start_s < 0 else a.start_s
        a.ids.append(t)
        a.out, a.done = finish(a.out, [t], a.req.max_new_tokens, ctx.eos)
        ctx.rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=s, end_s=e, drafted=0,
                      checked=0, accepted=0, emitted=1, verified_tokens=1, draft_s=0.0, target_s=e - s)
        count_round(a, e)
        ctx.on_tokens(1)
    ctx.rec.span("target", "decode", s, e, request_id=span_request(running), round_idx=r, batch=len(running))


def _sync_round(ctx: RealContext, running: list[Active], r: int, draft_model: Any) -> None:
    s = ctx.now()
    windows: list[ChainWindow | None] = []
    proposals: list[tuple[list[int], torch.Tensor] | None] = []
    for a in running:
        a.policy.before_round(len(running))
        gamma = a.policy.next_gamma()
        if isinstance(a.draft, ModelDraft | EarlyExitDraft | RowEagleDraft):
            windows.append(ChainWindow(a.draft, a.ids, gamma, a.gen, a.policy))
            proposals.append(None)
        else:  # a lookup: no forward
            windows.append(None)
            proposals.append(a.draft.propose(a.ids, gamma, a.gen, a.policy))
    while True:  # step j: one draft forward over every request still drafting
        step = [(a, w, w.next_feed()) for a, w in zip(running, windows) if w is not None and w.next_feed() is not None]
        if not step:
            break
        if draft_model is not None:
            logits = forward_batch(draft_model, [Feed(a.draft_row, toks, pos) for a, _, (toks, pos) in step])
        elif isinstance(step[0][0].draft, RowEagleDraft):
            logits = [lg[None] for lg in eagle_rows_logits([(a.draft, toks, pos) for a, _, (toks, pos) in step])]  # type: ignore[misc]
        else:  # early exit: the target's first layers on the request's own row
            exit_layer = step[0][0].draft.exit_layer  # type: ignore[union-attr]
            logits = forward_batch(ctx.target.model, [Feed(a.row, toks, pos) for a, _, (toks, pos) in step],
                                   layers=exit_layer)
        for (_, w, _), lg in zip(step, logits):
            w.take(lg[-1])
    proposals = [w.result() if w is not None else p for w, p in zip(windows, proposals)]
    m = ctx.now()
    feeds = [Feed(a.row, [a.ids[-1], *g], len(a.ids) - 1) for a, (g, _) in zip(running, proposals)]
    if any(isinstance(a.draft, EagleDraft) for a in running):  # the head reads the target's features
        logits, hidden = forward_batch_features(ctx.target.model, feeds)
    else:  # logits only: on a GPU this replays the batched CUDA graphs (features would run eagerly)
        logits, hidden = forward_batch(ctx.target.model, feeds), [None] * len(running)
    steps = [speculative_step(standardize(lg, ctx.params), q, draft_tokens=torch.tensor(g, dtype=torch.long),
                              generator=a.gen) for a, (g, q), lg in zip(running, proposals, logits)]
    e = ctx.now()
    features = ctx.rec.extra_round_columns.setdefault("draft_features", [])
    forwards = 0
    for a, (g, _), st, feats in zip(running, proposals, steps, hidden):
        a.start_s = s if a.start_s < 0 else a.start_s
        n, k = st.accepted, len(g)
        a.ids.extend(st.tokens)
        if isinstance(a.draft, EagleDraft):  # the target's features of the old root and accepted guesses
            assert feats is not None
            a.draft.commit(a.ids, n, k, features=feats[:n + 1])
        else:
            a.draft.commit(a.ids, n, k)
        before = len(a.out)
        a.out, a.done = finish(a.out, st.tokens, a.req.max_new_tokens, ctx.eos)
        a.policy.observe(k, n)
        features.append([x for row in a.draft.last_features for x in row])
        forwards += 0 if isinstance(a.draft, NgramDraft) else k + a.draft.last_dropped
        ctx.rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=s, end_s=e, drafted=k,
                      checked=n + (n < k), accepted=n, emitted=len(a.out) - before, verified_tokens=k + 1,
                      draft_s=m - s, target_s=e - m)
        count_round(a, e)
        ctx.on_tokens(len(a.out) - before)
    ctx.extra["draft_forwards"] = ctx.extra.get("draft_forwards", 0) + forwards
    ctx.rec.span("draft", "draft", s, m, request_id=span_request(running), round_idx=r, batch=len(running))
    ctx.rec.span("target", "verify", m, e, request_id=span_request(running), round_idx=r, batch=len(running))


def _grow_tree(ctx: RealContext, a: Active, meet: Rendezvous, *, target_rows: CacheRows,
               draft_rows: CacheRows | None) -> None:
    """The serial tree's drafter and verifier of a request, on its own cache rows. An eagle
    head's tree reads the target's features: its verification keeps them (``RowModel``)."""
    s = ctx.exp.schedule
    assert draft_rows is not None  # testbed.config_validate: a tree under load needs a draft model or head
    kv = ctx.state.setdefault("tree_kv", TreeKvStats())
    sample = ctx.state.setdefault("tree_rows", DraftRowSample())
    if isinstance(a.draft, RowEagleDraft):
        source: DraftSource = RowEagleTreeTokens(a.draft, ctx.params, list(a.ids), meet=meet,
                                                 index=lambda: a.index, generator=a.gen)
        target = RowModel(target_rows, a.row, meet, lambda: a.index, features=True)
        a.verifier = TargetTreeTokens(target, ctx.params, a.gen, features_of=lambda rows: target.last_hidden[rows])
    else:
        source = DraftTreeTokens(RowModel(draft_rows, a.draft_row, meet, lambda: a.index), ctx.params,
                                 list(a.ids), a.gen)
        a.verifier = TargetTreeTokens(RowModel(target_rows, a.row, meet, lambda: a.index), ctx.params, a.gen)
    a.drafter = TreeDrafter(source, width=s.tree_width, budget=s.tree_budget, kv=kv, rows=sample)


def _tree_round(ctx: RealContext, running: list[Active], r: int, meet: Rendezvous) -> None:
    """Every request's tree expanded d times and filled (expansion j of every request in one
    batched draft forward), its subtree selected, all subtrees verified in one batched target
    forward, then the re-roots (their KV moves per row), as sim/runtime/batching.py's tree round."""
    depth = ctx.exp.schedule.tree_depth or ctx.exp.schedule.gamma
    for i, a in enumerate(running):
        a.index = i

    def grow(a: Active) -> Any:
        for _ in range(depth):
            if a.drafter.expand() is None:
                break
        a.drafter.fill()
        return a.drafter.select()

    s = ctx.now()
    batches = meet.run([lambda a=a: grow(a) for a in running])
    m = ctx.now()
    outcomes = meet.run([lambda a=a, b=b: a.verifier.verify(b) for a, b in zip(running, batches)])
    e = ctx.now()
    for a, batch, res in zip(running, batches, outcomes):
        a.start_s = s if a.start_s < 0 else a.start_s
        before = len(a.out)
        a.out, a.done = finish(a.out, res.tokens, a.req.max_new_tokens, ctx.eos)
        a.drafter.advance(res.tokens, features=res.features)
        ctx.rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=s, end_s=e,
                      drafted=len(batch) - 1, checked=res.checked, accepted=res.accepted,
                      emitted=len(a.out) - before, verified_tokens=len(batch), draft_s=m - s, target_s=e - m)
        count_round(a, e)
        ctx.on_tokens(len(a.out) - before)
        ctx.extra.update(a.drafter.summary_fields(), tree_depth_used=depth)
    rid, n = span_request(running), len(running)
    ctx.rec.span("draft", "draft", s, m, request_id=rid, round_idx=r, batch=n)
    ctx.rec.span("target", "verify", m, e, request_id=rid, round_idx=r, batch=n)
    ctx.rec.span("draft", "reroot", e, ctx.now(), request_id=rid, round_idx=r, batch=n)


def _record(ctx: RealContext, a: Active) -> None:
    q = a.req
    ctx.rec.request(RequestRecord(
        request_id=q.request_id, prompt_id=q.prompt_id, prompt_len=len(q.prompt_ids), output_ids=a.out,
        generated=len(a.out), prefill_s=a.prefill_s, decode_s=ctx.now() - a.start_s, rounds=a.rounds,
        arrival_s=a.arrival_s, queue_s=a.admit_s - a.arrival_s, first_token_s=a.first_token_s,
        finish_s=ctx.now()))
