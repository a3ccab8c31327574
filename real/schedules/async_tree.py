"""`async` on real models: SwiftSpec's parallel tree generation (seed 002 §3.1–3.2, Algorithm 1).

The mirror of sim/schedules/async_tree.py: the same two worker functions (``draft_worker``,
``target_worker``) over testbed's ``TreeDrafter`` and ``verify_tree``; here they run in the
processes of two disjoint device groups on the wall clock instead of as SimPy processes.
Per iteration:

- target: take the subtree (bs nodes), one tree-masked forward over it, verify it (greedy path
  match at temperature 0, the lossless multi-candidate rule otherwise), send the emitted tokens
  back; stop once max_new_tokens (or EOS) are out.
- draft, meanwhile: expand the tree d times (w most probable leaves per forward); then take the
  verified tokens, re-root (``TreeDrafter.advance``: the surviving subtree's KV slots are kept
  by compaction, verified tokens the draft never computed are fed with its next forward), expand
  until the tree holds at least bs nodes, and send the most probable subtree of size bs.

As in the simulator exactly one subtree is in flight: the draft sends round r+1's subtree only
after it re-rooted on round r's verified tokens. Every message carries its round as ``version``
and the committed sequence length the tree was rooted on (``committed``); the target refuses a
subtree whose version or root is not the one it expects (``StaleTree``) instead of verifying it
as if it were current.

Groups. Only the leaders talk over the bridge; every rank of a group runs the same code on its
tensor-parallel shard (SPMD), and a leader hands each message it receives to its followers (one
``WorkerContext.broadcast_decision`` per message: ``Peer``) so the group stays in lockstep.

d: ``testbed.spec.tree_drafter.AsyncDepth`` — ``schedule.tree_depth``, or, when 0, for the first
round from t_target (a target forward over bs tokens plus both messages) and t_draft (one whole
expansion of w leaves: the draft's forward, the distributions, the children picked and grown —
what the draft does d times while the target verifies), measured at the start of the run on the
run's own devices at the middle of the first request, one after the other (each alone) — the
simulator models the same two times from its cost model. The probe's tree grows after the
prompt and copies of its last token, where the n-gram draft finds one continuation per lookup:
its timed expansions have one leaf (the simulator charges the same), so its first d is at the
cap. Every later round's d comes from the rounds done: the target's time for a subtree (from
the draft's sending it to the target's sending the verified tokens, plus the reply's one-way
time) and the draft's expansion times (spans), medians over the last rounds; the leader's d is
shared with its group's followers.

Message formats (``real.runtime.links.Message``; packed and checked in real/runtime/async_messages.py):
``Kind.TREE`` = int32 rows (token, parent, draw index) per batch node, float64 (draft seconds
since the last subtree, draft prefill end), and at temperature > 0 the draft's q at each batch
node with children in the batch; ``Kind.VERIFIED`` (``Kind.STOP`` for a request's last round) =
the emitted tokens (int64), and for a feature-level (eagle) draft the target's last hidden
states of the old root and the accepted tokens ``[len(tokens), dim]`` (the target's dtype: the
bytes the simulator charges, ``testbed.links.features_bytes``).

Eagle head (real.model.eagle, real.model.eagle_tree): the draft group holds the head and the
target's embedding, final norm and LM head it reads; it has no prefill of its own. After its
prefill the target sends its features of the prompt (``Kind.ACTIVATIONS``, ``[n - 1, dim]``) and
the draft starts from them (``Side.start_features``): the request's decoding starts once they
have arrived. Every reply's features go to ``TreeDrafter.advance(tokens, features=)``, which
feeds the new prefix again with them, as the serial tree does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from real.model.runners import prefill
from real.model.tree_tokens import DraftTreeTokens, ForwardModel, TargetTreeTokens
from real.runtime.async_messages import (
    StaleTree,
    pack_batch,
    prompt_features,
    prompt_message,
    reply_message,
    reply_parts,
    unpack_batch,
)
from real.runtime.context import RealRequest, finish
from real.runtime.links import Kind, Message, Transport
from real.schedules import TwoGroups, register
from testbed.recorder import RequestRecord, RunRecorder
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import (
    AsyncDepth,
    DraftRowSample,
    DraftSource,
    TreeDrafter,
    TreeKvStats,
)

PROBE_REPEATS = 15  # per model for d (after one warm-up): 5 swung d by ±3 on this host
PROBE_TURNS = 5  # ... timed in 5 alternating turns of 3 (probe_draft)


class Peer:
    """The other group as one rank sees it: a leader sends and receives over the bridge and
    hands every message it receives to its followers (``share``) so they stay in lockstep;
    a follower sends nothing and gets the leader's messages."""

    def __init__(self, inbox: Transport | None, outbox: Transport | None,
                 share: Callable[[Any], Any]) -> None:
        self.inbox, self.outbox, self.share = inbox, outbox, share

    def send(self, msg: Message) -> None:
        if self.outbox is not None:
            self.outbox.send(msg)

    def recv(self) -> Message:
        return self.share(self.inbox.recv() if self.inbox is not None else None)


@dataclass
class Side:
    """One rank's half of the schedule: its group's model (a shard under TP), its view of the
    peer group, its recorder (the leader's is the run's) and the run clock."""

    model: Any  # real.model.decoder.Transformer (prefill)
    fwd: ForwardModel  # the same model for tree-masked forwards
    params: SamplingParams
    peer: Peer
    rec: RunRecorder
    now: Callable[[], float]
    seed: int
    # seconds of bookkeeping per kind (select + pack, unpack, re-root/compaction)
    overhead: dict[str, float] = field(default_factory=dict)
    kv: TreeKvStats = field(default_factory=TreeKvStats)
    rows: DraftRowSample = field(default_factory=DraftRowSample)  # the draft's ranked q rows
    # the draft's DraftSource for (committed tokens, generator); None: DraftTreeTokens over
    # ``fwd`` (a model draft). The n-gram draft has no model: ``model`` and ``fwd`` are None.
    draft_source: Callable[[list[int], torch.Generator], DraftSource] | None = None
    # draft side, an eagle head: its start from the target's prompt features ``[n - 1, dim]``
    # (None: zeros, for the probe's tree, whose expansions cost the same whatever the values)
    start_features: Callable[[list[int], torch.Tensor | None], None] | None = None
    # target side: its replies carry its features (the draft is an eagle head that reads them)
    reply_features: bool = False
    probe: Any = None  # real.calibrate.probe_forward.RunProbe of this group's model (probe_before_request)

    def new_draft_source(self, ids: list[int], generator: torch.Generator) -> DraftSource:
        if self.draft_source is not None:
            return self.draft_source(ids, generator)
        return DraftTreeTokens(self.fwd, self.params, ids, generator)

    def generator(self, request_id: int, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + request_id + salt)

    def charge(self, kind: str, seconds: float) -> None:
        self.overhead[kind] = self.overhead.get(kind, 0.0) + seconds


TARGET_SALT, DRAFT_SALT = 0, 500_000_017  # independent sampling streams of the two groups


# --------------------------------------------------------------------------- choose d
def _forward_timer(side: Side, n: int, context: int) -> Callable[[], float]:
    """Seconds of one forward over ``n`` tokens after ``context`` cache entries (the entries'
    values do not matter for the time; the request's prefill overwrites them)."""
    pos = torch.arange(context, context + n)
    mask = torch.ones(n, context + n, dtype=torch.bool)

    def timed() -> float:
        t = side.now()
        side.fwd.logits([0] * n, input_pos=pos, mask=mask, position_ids=pos)
        return side.now() - t
    timed()  # warm-up
    return timed


def _expansion_timer(side: Side, exp: Any, req: RealRequest) -> Callable[[], float | None]:
    """Seconds of one tree expansion as the draft worker does d of them a round: the forward
    over the w leaves, their distributions, the children picked and the tree grown (the
    simulator charges tree_forward + tree_expand_extra for the same), on a tree grown at the
    middle of ``req`` (the KV entries written are overwritten by the request's own prefill);
    None once the tree cannot grow."""
    s = exp.schedule
    ids = list(req.prompt_ids) + [req.prompt_ids[-1]] * (req.max_new_tokens // 2)
    if side.start_features is not None:  # an eagle head: zero features (the warm-up feeds the prefix)
        side.start_features(ids, None)
    drafter = TreeDrafter(side.new_draft_source(ids, torch.Generator().manual_seed(0)),
                          width=s.tree_width, budget=s.tree_budget)

    def timed() -> float | None:
        t = side.now()
        return None if drafter.expand() is None else side.now() - t
    timed()  # warm-up
    return timed


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] if times else 0.0


def probe_target(side: Side, exp: Any, req: RealRequest) -> None:
    """Target group: time verification forwards at the middle of ``req`` in turns with the draft
    group's expansions (``probe_draft``), each group alone, and send each turn's median."""
    ref = len(req.prompt_ids) + req.max_new_tokens // 2
    timed = _forward_timer(side, exp.schedule.tree_budget, ref)
    for _ in range(PROBE_TURNS):
        side.peer.recv()  # the draft group waits: time the verification alone
        t = _median([timed() for _ in range(PROBE_REPEATS // PROBE_TURNS)])
        side.peer.send(Message(Kind.DATA, request_id=req.request_id,
                               tensors=(torch.tensor([t], dtype=torch.float64),)))
    side.peer.recv()  # the draft's answer: the link's one-way time and d, for the summary


def probe_draft(side: Side, exp: Any, req: RealRequest) -> tuple[AsyncDepth, float, float]:
    """Draft group: (d's controller, t_target, t_draft) from the target's verification forwards, the
    message's one-way time (both messages of a round) and the expansions timed here. The two
    groups time in ``PROBE_TURNS`` alternating turns, each alone (the simulator's choose_depth
    likewise takes the uncontended figures): one group's figure measured seconds after the
    other's read a different machine on this host (t_target 82 against 65-69 ms in the runs
    around it, and d = 12 where 8-9 was right: 20 % fewer tokens/s)."""
    s = exp.schedule
    timed = _expansion_timer(side, exp, req)
    targets: list[float] = []
    drafts: list[float] = []
    one_way = 0.0
    for _ in range(PROBE_TURNS):
        side.peer.send(Message(Kind.DATA, request_id=req.request_id))  # the target's turn
        msg = side.peer.recv()
        one_way = side.peer.share(max(0.0, side.now() - msg.sent_s))  # the leader's reading for everyone
        targets.append(float(msg.tensors[0][0]))
        drafts += [t for t in (timed() for _ in range(PROBE_REPEATS // PROBE_TURNS)) if t is not None]
    t_draft = side.peer.share(_median(drafts))  # (the leader's, as one_way)
    t_target = _median(targets) + 2 * one_way
    depth = AsyncDepth(tree_depth=s.tree_depth, t_target=t_target, t_draft=t_draft, reply_s=one_way)
    side.peer.send(Message(Kind.DATA, request_id=req.request_id, version=depth.depth,
                           tensors=(torch.tensor([t_target, t_draft], dtype=torch.float64),)))
    return depth, t_target, t_draft


def probe_before_request(side: Side, role: str, req: RealRequest) -> None:
    """Both groups, before each request: the target group times its model's probe forward
    while the draft group waits, then the draft group its own while the target waits
    (``side.probe``, a real.calibrate.probe_forward.RunProbe; the n-gram draft has none). Each alone, as
    the profile's probe and the simulator's drift factor take them."""
    rid, index = req.request_id, req.request_id
    if index % side.probe.every:
        return  # not a reading's turn (RunProbe: at most MAX_READINGS per run)
    if role == "target":
        side.peer.recv()  # the draft waits
        side.probe.take(index)
        side.peer.send(Message(Kind.DATA, request_id=rid))
        side.peer.recv()  # the draft has taken its reading
    else:
        side.peer.send(Message(Kind.DATA, request_id=rid))
        side.peer.recv()  # the target has taken its reading
        side.probe.take(index)
        side.peer.send(Message(Kind.DATA, request_id=rid))


# ------------------------------------------------------------------------------ workers
def target_worker(side: Side, req: RealRequest, eos: frozenset[int],
                  on_tokens: Callable[[int], None] = lambda n: None) -> list[int]:
    """SwiftSpec Algorithm 1, target side, for one request: verify each subtree the draft
    sends, send back the emitted tokens; records the rounds and the request."""
    rid, rec, now, model = req.request_id, side.rec, side.now, side.model
    ids = list(req.prompt_ids)
    if side.reply_features:  # the eagle head reads the hidden states of the target's forwards
        model.keep_hidden = True
    t0 = now()
    prefill(model, ids[:-1])
    if side.reply_features:
        side.peer.send(prompt_message(rid, len(ids), target_prompt_features(model, len(ids) - 1)))
    rec.span("target", "prefill", t0, now(), request_id=rid)
    features_of = (lambda rows: model.last_hidden[0, rows]) if side.reply_features else None
    verifier = TargetTreeTokens(side.fwd, side.params, side.generator(rid, TARGET_SALT),
                                features_of=features_of)
    mode = "topk" if side.params.greedy else "sample"
    out: list[int] = []
    r, start, t_prev = 0, None, now()
    while True:
        msg = side.peer.recv()
        u = now()
        if msg.kind != Kind.TREE or msg.request_id != rid or msg.version != r or msg.committed != len(ids):
            raise StaleTree(f"target expected the subtree of request {rid} round {r} rooted after "
                            f"{len(ids)} tokens, got kind {msg.kind} request {msg.request_id} "
                            f"version {msg.version} rooted after {msg.committed}")
        batch, draft_s, draft_prefill_end = unpack_batch(msg, mode)
        if start is None:  # decoding starts once both groups have prefilled
            start = max(t_prev, draft_prefill_end)
            t_prev = start
        s0 = now()
        side.charge("unpack", s0 - u)
        res = verifier.verify(batch)
        e = now()
        before = len(out)
        out, done = finish(out, res.tokens, req.max_new_tokens, eos)
        ids.extend(res.tokens)
        side.peer.send(reply_message(rid, r, done=done, committed=len(ids), tokens=res.tokens,
                                     features=res.features))
        rec.round(request_id=rid, round_idx=r, start_s=t_prev, end_s=e, drafted=len(batch) - 1,
                  checked=res.checked, accepted=res.accepted, emitted=len(out) - before,
                  verified_tokens=len(batch), draft_s=draft_s, target_s=e - s0)
        rec.span("target", "verify", s0, e, request_id=rid, round_idx=r)
        on_tokens(len(out) - before)
        side.charge("send", now() - e)
        t_prev = now()
        r += 1
        if done:
            break
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=start - t0, decode_s=now() - start, rounds=r))
    return out


def target_prompt_features(model: Any, n: int) -> torch.Tensor:
    """The target's last hidden states of the ``n`` tokens its prefill fed (none for a one-token
    prompt, which the eagle head refuses with its own message)."""
    if n == 0:
        return torch.zeros(0, model.args.dim, dtype=model.dtype)
    return model.last_hidden[0, :n]


def draft_worker(side: Side, req: RealRequest, depth: AsyncDepth | int, *, width: int, budget: int,
                 ) -> TreeDrafter:
    """SwiftSpec Algorithm 1, draft side, for one request: grow the tree, send the best subtree
    of ``budget`` nodes, grow d more times while the target verifies (d: ``depth``, an int or
    the run's ``AsyncDepth``, which the rounds' times update), re-root on the verified tokens;
    until the target says the request is done. Returns the drafter as it ended (its tree and
    KV cache, for tests)."""
    ctl = depth if isinstance(depth, AsyncDepth) else AsyncDepth.constant(depth)
    rid, rec, now = req.request_id, side.rec, side.now
    ids = list(req.prompt_ids)
    t0 = now()
    if side.start_features is not None:  # an eagle head: the target's features, no prefill here
        side.start_features(ids, prompt_features(side.peer.recv(), rid, len(ids)))
    elif side.model is not None:  # the n-gram draft has no cache to fill
        prefill(side.model, ids[:-1])
    prefill_end = now()
    rec.span("draft", "prefill", t0, prefill_end, request_id=rid)
    source = side.new_draft_source(ids, side.generator(rid, DRAFT_SALT))
    drafter = TreeDrafter(source, width=width, budget=budget, kv=side.kv, rows=side.rows)
    tree = drafter.tree

    def expand(r: int) -> float | None:
        s0 = now()
        if drafter.expand() is None:
            return None
        rec.span("draft", "expand", s0, now(), request_id=rid, round_idx=r)
        return now() - s0

    def fill(r: int) -> float:
        """Expand until the tree holds its budget (or has no leaf left); the seconds spent."""
        spent = 0.0
        while len(tree) < drafter.budget:
            dt = expand(r)
            if dt is None:
                break
            spent += dt
            times.append(dt)
        return spent

    r, times = 0, []  # times: expansions since d was last updated
    draft_s = fill(r)
    while True:
        s0 = now()
        batch = drafter.select()
        sent = now()
        side.peer.send(Message(Kind.TREE, request_id=rid, round=r, version=r, committed=len(ids),
                               tensors=pack_batch(batch, draft_s, prefill_end)))
        side.charge("select", now() - s0)
        draft_s = 0.0
        for _ in range(ctl.next_round()):  # grow while the target verifies
            dt = expand(r + 1)
            if dt is None:
                break
            draft_s += dt
            times.append(dt)
        msg = side.peer.recv()
        if msg.kind not in (Kind.VERIFIED, Kind.STOP) or msg.request_id != rid or msg.version != r:
            raise StaleTree(f"draft expected the verified tokens of request {rid} round {r}, got "
                            f"kind {msg.kind} request {msg.request_id} version {msg.version}")
        if ctl.adaptive:  # the leader's reading for its whole group (the followers' clocks differ)
            # (round 0's subtree may have waited for the target's prefill: no target time)
            span = msg.sent_s - sent if r else None
            ctl.depth = side.peer.share(ctl.observe(target_span=span, expansions=times))
        times = []
        if msg.kind == Kind.STOP:
            return drafter
        s0 = now()
        tokens, features = reply_parts(msg)
        drafter.advance(tokens, features=features)  # re-root + KV compaction (+ an eagle head's features)
        if len(ids) != msg.committed:
            raise StaleTree(f"draft re-rooted after {len(ids)} tokens, the target after {msg.committed}")
        rec.span("draft", "reroot", s0, now(), request_id=rid, round_idx=r)
        side.charge("reroot", now() - s0)
        r += 1
        draft_s += fill(r)


# the registry's entry: the two groups' halves, run by the two_groups layout's runner (real/runtime/async_run.py)
register("async", TwoGroups(target=target_worker, draft=draft_worker, probe_target=probe_target,
                            probe_draft=probe_draft, before_request=probe_before_request))
