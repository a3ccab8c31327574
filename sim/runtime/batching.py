"""Serving under load in the simulator: arrivals, admission and continuous batching.

Requests arrive as ``workload.arrival`` says (testbed/arrivals.py) and wait in one first-come,
first-served queue; between rounds (iteration-level scheduling, as vLLM and SGLang do) the
server admits waiting requests within ``serving.max_batch`` and ``serving.kv_budget_tokens``
(testbed/admission.py, the real backend's rule too). Newly admitted requests are prefilled
first (one after the other, the batch waiting), then one round serves every running request:

- ``ar``: one target forward over every request's next token;
- ``sync``: each request's policy picks its γ (``testbed.spec.lookahead``: per request, so a
  policy may pick by the batch), the draft runs its chain as batched steps (step j serves every
  request drafting a j-th token), then one target forward verifies every request's window;
- ``sync`` with ``schedule.tree=true`` (the serial tree): every request's tree is expanded d
  times (and filled to bs nodes) in batched tree-masked draft forwards (expansion j serves every
  request's j-th), each request selects its subtree, one target forward verifies all subtrees,
  and the re-roots follow (their bookkeeping serial, one request after another);
- ``async``: SwiftSpec's two groups, each step over the batch (sim/runtime/batching_async.py).

A pipeline over nodes (``decentralized``) is served by sim/runtime/pipelined.py instead.

Forwards over several requests cost ``CostModel.batch_forward`` (the weights streamed once, each
request's attention over its own cache). Acceptance is each request's own oracle sequence, as
when served alone. One closed-loop client (``workload.concurrency=1``) makes every round a batch
of one and reproduces the one-request-at-a-time schedules' times exactly.

Recorded per request: arrival, queueing delay, first and last token (requests.parquet); per
round and request a rounds.parquet row (the batch's draft and target times); per batched
forward a timeline span with the batch size (timeline.parquet's ``batch``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from sim.oracle.tree_tokens import batched_expansion_seconds
from sim.runtime.batching_async import async_prefill, async_round
from sim.runtime.context import SimContext, SimRequest
from sim.schedules.sync import next_pending
from testbed.admission import Admission, count_round, span_request
from testbed.recorder import RequestRecord
from testbed.schedules import spec_of
from testbed.spec.lookahead import lookahead_for


@dataclass
class Active:
    """One admitted request's state between rounds."""

    req: SimRequest
    arrival_s: float
    admit_s: float
    seq: Any  # its oracle sequence (sim.oracle.base); None for a tree
    policy: Any = None  # sync: its lookahead policy
    drafter: Any = None  # the serial tree: its sim.oracle.tree_tokens.TimedTreeDrafter
    seq_len: int = 0  # tokens in the sequence (the target has seq_len - 1 cached)
    pending: int = 1  # sync: tokens the draft feeds before its first guess
    prefill_s: float = 0.0
    start_s: float = -1.0  # its first decode round's start
    first_token_s: float = float("nan")
    end_s: float = float("nan")  # its last token (async: the target's, before the reply's transfer)
    round_start: float = -1.0  # async: its current round's start (its last reply, or its prefill's end)
    draft_s: float = 0.0  # async: draft time since its last subtree was sent
    rounds: int = 0
    generated: int = 0
    out: list[int] = field(default_factory=list)  # the tokens, where the oracle has them

    @property
    def done(self) -> bool:
        return self.generated >= self.req.max_new_tokens


def serve(ctx: SimContext, requests: list[SimRequest], *, arrivals: list[float] | None = None,
          ) -> Generator[Any, Any, None]:
    """The server: admit, prefill, one batched round; until every request is answered.
    ``arrivals``: each request's arrival time (poisson, trace), else a closed loop."""
    env, exp = ctx.env, ctx.exp
    spec = spec_of(exp)
    drafts = spec.drafts
    queue = Admission(exp)
    wake: list[Any] = [None]  # the event an idle server waits on

    def arrive(req: SimRequest) -> None:
        queue.arrive(req, env.now)
        if wake[0] is not None and not wake[0].triggered:
            wake[0].succeed()

    unsent = send_requests(ctx, requests, arrivals, arrive)
    running: list[Active] = []
    finished, r = 0, 0
    while finished < len(requests):
        if not running and not queue.waiting:
            wake[0] = env.event()
            yield wake[0]
        admitted = []
        for req, t in queue.admit(len(running)):
            if spec.tree:  # (async too) its token source draws the request's oracle sequence itself
                from sim.oracle.tree_tokens import TimedTreeDrafter, tree_tokens

                a = Active(req, arrival_s=t, admit_s=env.now, seq=None, seq_len=req.prompt_len,
                           drafter=TimedTreeDrafter(ctx, tree_tokens(ctx, req)))
            else:
                a = Active(req, arrival_s=t, admit_s=env.now, seq=ctx.oracle.sequence(req.request_id, req.prompt_len),
                           policy=lookahead_for(exp) if drafts else None, seq_len=req.prompt_len)
            admitted.append(a)
        if admitted:
            if spec.concurrent:
                for a in admitted:
                    yield from async_prefill(ctx, a)
                    a.round_start = env.now
            else:
                yield from _prefill(ctx, admitted, drafts=drafts)
            running.extend(admitted)
        if not running:
            continue
        if spec.concurrent:
            yield from async_round(ctx, running, r)
        elif spec.tree:
            yield from _tree_round(ctx, running, r)
        elif drafts:
            yield from _sync_round(ctx, running, r)
        else:
            yield from _ar_round(ctx, running, r)
        r += 1
        for a in [a for a in running if a.done]:
            running.remove(a)
            queue.release(a.req)
            finished += 1
            _record(ctx, a)
            if arrivals is None and unsent:
                arrive(unsent.popleft())


def send_requests(ctx: SimContext, requests: list[SimRequest], arrivals: list[float] | None,
                  arrive: Callable[[SimRequest], None]) -> deque[SimRequest]:
    """Start the arrivals: a closed loop's first ``workload.concurrency`` requests now, the
    returned queue holding the rest (the server sends the next when one is done); or a process
    that sends each request at its arrival time (an empty queue)."""
    env = ctx.env
    if arrivals is not None:
        def timed() -> Generator[Any, Any, None]:
            for req, t in zip(requests, arrivals):
                if t > env.now:
                    yield env.timeout(t - env.now)
                arrive(req)
        env.process(timed())
        return deque()
    unsent = deque(requests)
    for _ in range(min(ctx.exp.workload.concurrency, len(unsent))):
        arrive(unsent.popleft())
    return unsent


def _prefill(ctx: SimContext, admitted: list[Active], *, drafts: bool) -> Generator[Any, Any, None]:
    env, cost, rec = ctx.env, ctx.cost, ctx.rec
    for a in admitted:  # one after the other: a prefill is a large forward of its own
        t0 = env.now
        pf_target = cost.prefill("target", a.req.prompt_len)
        pf_draft = cost.prefill("draft", a.req.prompt_len) if drafts else 0.0
        yield env.timeout(pf_target + pf_draft)
        rid = a.req.request_id
        rec.span("target", "prefill", t0, t0 + pf_target, request_id=rid)
        if drafts:
            rec.span("draft", "prefill", t0 + pf_target, env.now, request_id=rid)
        a.prefill_s = env.now - t0


def _ar_round(ctx: SimContext, running: list[Active], r: int) -> Generator[Any, Any, None]:
    env, rec = ctx.env, ctx.rec
    s = env.now
    dt = ctx.cost.batch_forward("target", [(1, a.seq_len - 1) for a in running])
    yield env.timeout(dt)
    for a in running:
        a.start_s = s if a.start_s < 0 else a.start_s
        a.out.append(a.seq.ar_token())
        a.generated += 1
        a.seq_len += 1
        rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=s, end_s=env.now, drafted=0,
                  checked=0, accepted=0, emitted=1, verified_tokens=1, draft_s=0.0, target_s=dt)
        count_round(a, env.now)
    rec.span("target", "decode", s, env.now, request_id=span_request(running), round_idx=r, batch=len(running))


def _sync_round(ctx: SimContext, running: list[Active], r: int) -> Generator[Any, Any, None]:
    env, cost, rec = ctx.env, ctx.cost, ctx.rec
    s = env.now
    plans = []
    for a in running:  # the oracle decides first (it does not depend on time), as in sync
        a.policy.before_round(len(running))
        gamma = a.policy.next_gamma()
        outcome = a.seq.chain_round(gamma, a.policy)
        k = gamma if outcome.proposed is None else outcome.proposed
        plans.append((a, gamma, outcome, k, k + outcome.dropped))
    if len(running) == 1:
        a, _, _, k, fw = plans[0]
        draft_s = cost.draft_chain(a.pending, fw, a.seq_len)
    else:  # step j: one draft forward over every request still drafting
        draft_s = 0.0
        for j in range(max(p[4] for p in plans)):
            rows = [(a.pending, a.seq_len - a.pending) if j == 0 else (1, a.seq_len + j - 1)
                    for a, _, _, _, fw in plans if fw > j]
            draft_s += cost.batch_forward("draft", rows)
    target_s = cost.batch_forward("target", [(k + 1, a.seq_len - 1) for a, _, _, k, _ in plans])
    yield env.timeout(draft_s + target_s)
    ngram = ctx.exp.pair.draft.kind == "ngram"
    for a, _, outcome, k, fw in plans:
        a.start_s = s if a.start_s < 0 else a.start_s
        n = outcome.accepted
        emitted = min(n + 1, a.req.max_new_tokens - a.generated)
        a.out.extend(outcome.tokens[:emitted])
        a.generated += emitted
        a.seq_len += n + 1
        a.pending = next_pending(a.pending, k, n, forwards=fw, dropped=outcome.dropped)
        a.policy.observe(k, n)
        rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=s, end_s=env.now, drafted=k,
                  checked=n + (n < k), accepted=n, emitted=emitted, verified_tokens=k + 1,
                  draft_s=draft_s, target_s=target_s)
        count_round(a, env.now)
        ctx.extra["draft_forwards"] = ctx.extra.get("draft_forwards", 0) + (0 if ngram else fw)
    rec.span("draft", "draft", s, s + draft_s, request_id=span_request(running), round_idx=r, batch=len(running))
    rec.span("target", "verify", s + draft_s, env.now, request_id=span_request(running), round_idx=r, batch=len(running))


def _tree_round(ctx: SimContext, running: list[Active], r: int) -> Generator[Any, Any, None]:
    env, cost, rec, s = ctx.env, ctx.cost, ctx.rec, ctx.exp.schedule
    depth = s.tree_depth or s.gamma
    select_s, reroot_s = cost.tree_round_bookkeeping(running[0].drafter.width)  # (real/calibrate/tree.py)
    t_round = env.now
    grown = []  # per request: its expansions, then the fill's (the trees change now, time below)
    for a in running:
        core = a.drafter.core
        steps = []
        for _ in range(depth):
            step = core.expand()
            if step is None:
                break
            steps.append(step)
        grown.append((steps, list(core.fill())))

    def phase(which: int) -> float:  # expansion j of every request that has one: one forward
        t = 0.0
        for j in range(max((len(g[which]) for g in grown), default=0)):
            at = [g[which][j] for g in grown if len(g[which]) > j]
            t += batched_expansion_seconds(cost, at)
        return t

    draft_s = phase(0)
    draft_s += phase(1)
    draft_s += select_s * len(running)
    picked = [a.drafter.select() for a in running]
    target_s = cost.batch_forward("target", [(len(b), a.seq_len - 1) for a, (b, _) in zip(running, picked)],
                                  tree=True)
    yield env.timeout(draft_s + target_s)
    for a, (batch, keys) in zip(running, picked):
        a.start_s = t_round if a.start_s < 0 else a.start_s
        res = a.drafter.toks.verify(batch, keys)
        emitted = min(len(res.tokens), a.req.max_new_tokens - a.generated)
        a.out.extend(res.tokens[:emitted])
        a.generated += emitted
        a.seq_len += len(res.tokens)
        rec.round(request_id=a.req.request_id, round_idx=a.rounds, start_s=t_round, end_s=env.now,
                  drafted=len(batch) - 1, checked=res.checked, accepted=res.accepted, emitted=emitted,
                  verified_tokens=len(batch), draft_s=draft_s, target_s=target_s)
        count_round(a, env.now)
        a.drafter.advance(res.tokens)
    rid, n = span_request(running), len(running)
    rec.span("draft", "draft", t_round, t_round + draft_s, request_id=rid, round_idx=r, batch=n)
    rec.span("target", "verify", t_round + draft_s, env.now, request_id=rid, round_idx=r, batch=n)
    if reroot_s > 0.0:  # between rounds: in the requests' decode time, in no round's
        t = env.now
        yield env.timeout(reroot_s * n)
        rec.span("draft", "reroot", t, env.now, request_id=rid, round_idx=r, batch=n)
    ctx.extra["tree_depth_used"] = depth


def _record(ctx: SimContext, a: Active) -> None:
    q, end = a.req, a.end_s if a.end_s == a.end_s else ctx.env.now
    # as the one-at-a-time schedules: sync keeps its tokens, ar and trees only an oracle's real ids
    ids = a.out if a.policy is not None or ctx.oracle.produces_ids else []
    if a.drafter is not None:
        ctx.extra.update(a.drafter.summary_fields())
    ctx.rec.request(RequestRecord(
        request_id=q.request_id, prompt_id=q.prompt_id, prompt_len=q.prompt_len, output_ids=ids,
        generated=a.generated, prefill_s=a.prefill_s, decode_s=end - a.start_s, rounds=a.rounds,
        arrival_s=a.arrival_s, queue_s=a.admit_s - a.arrival_s, first_token_s=a.first_token_s,
        finish_s=end))
