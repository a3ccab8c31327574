"""The target as a pipeline of layer ranges over processes joined by emulated WAN links (DSD's
setting, seed 003): the mirror of sim/runtime/pipeline.py.

Each stage process holds the target's layers ``[lo, hi)`` of the placement's split
(``testbed.placement.split_layers``, the simulator's split); the first also the embedding and the
draft, the last the final norm and LM head (every stage loads the whole checkpoint: an eagle
draft on the first stage drafts through the final norm and LM head as well). One *traversal*
feeds a window of tokens at cache slots ``committed-1 ..``: stage i runs its layers and ships the
hidden states to stage i+1 over ``real/runtime/links.py`` (``network=`` delay); the last stage
computes the logits, verifies the window (``verify``: Algorithm 1 or DSD's adaptive rule,
real/schedules/decentralized.py) and returns the emitted tokens to the first stage (with the
target's features for an eagle draft), closing the loop across N links exactly as
``sim.runtime.pipeline.Pipeline.forward`` + ``send_back`` do.

Every window carries the committed sequence length (``Message.committed``): a stage writes the
window's K/V at slots ``committed-1 ..``, so the slots of tokens rejected in the previous round
are simply overwritten — rolling back costs nothing on any stage (real/model/decoder.py's static cache).
Every message also carries the request's KV-cache row (``Message.row``), which the first stage
chose: 0 when requests are served one at a time; under load (real/runtime/pipelined.py) each
request in flight has a row of its own on every stage, and a stage runs its layers on that row
(real/model/batch.py). A row is reused only after the first stage has the request's last
answer, when no message of it is left anywhere in the ring.

The first stage's side of a request is a *flow*: a generator that yields each time it has sent
a message and waits for the last stage's answer, which it is sent back (``run_alone`` serves one
request so; real/runtime/pipelined.py interleaves several).

Messages (``real.runtime.links.Message``, ``version`` = the phase: 0 the schedule, 1 its `ar` baseline):

- ``Kind.ACTIVATIONS`` stage i -> i+1: hidden ``[1, T, dim]`` (model dtype), the window's tokens
  (int32 ``[T]``: the last committed token and the γ guesses; the last stage verifies them), and,
  when the verifier needs them, the draft distributions (``pack_dists``). ``round`` -1 is the
  prompt (``committed`` 0, no verification).
- ``Kind.DATA`` last -> first after the prompt: the last stage's prefill end (float64), and when
  the first stage's draft reads the target's features (an eagle head, ``Stage.features``) the
  features of the fed prompt tokens (``[P, dim]``, model dtype: the last layer's output before
  the final norm, what ``Transformer.last_hidden`` keeps in one process).
- ``Kind.VERIFIED`` last -> first: the emitted tokens (int32 ``[n+1]``), and for an eagle draft
  the features of the window's first n+1 positions (``[n+1, dim]``: the old root and the n accepted
  guesses, the rows ``real.model.eagle.EagleDraft.commit`` takes); ``committed`` = the new
  sequence length. ``testbed.links.dsd_prompt_answer_bytes`` and ``dsd_verified_bytes`` are the
  sizes both backends charge.
- ``Kind.STOP`` first -> ... -> last: no more requests.

``ar_pipeline`` is `ar` over the pipeline (the baseline of `decentralized`): a window of one token
and no guesses per traversal.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from real.model.batch import Feed, copy_prefix, layers_rows
from real.model.decoder import Transformer
from real.runtime.context import RealRequest, finish
from real.runtime.links import Kind, LinkError, Message, Transport
from testbed.recorder import RequestRecord, RunRecorder

SCHEDULE_PHASE, BASELINE_PHASE = 0, 1

# The last stage's decision on a window: (logits [T, V], the window message) -> emitted tokens.
Verify = Callable[[torch.Tensor, Message], list[int]]
T = TypeVar("T")
# The first stage's side of one request: yields after each send, is sent the answer, returns T.
Flow = Generator[None, Message, T]


def run_alone(stage: Stage, flow: Flow[T]) -> T:
    """Serve one flow to its end, receiving each answer it waits for."""
    try:
        flow.send(None)  # type: ignore[arg-type]
        while True:
            flow.send(stage.recv())
    except StopIteration as done:
        return done.value


class PipelineProtocolError(LinkError):
    """A message that does not belong where it arrived (wrong kind, request, round or length)."""


# ------------------------------------------------------------------- draft distributions
def pack_dists(q: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
    """The window's draft distributions ``q [γ, V]`` for the wire. ``topk`` > 0: the draft
    samples from its top-k (``schedule.draft_topk``), so each row has at most k non-zeros (a few
    more on a tie at the k-th logit): send the values (fp32) and indices (int32) of the m largest
    entries, m = the most non-zeros of any row — exactly q, so Algorithm 1 stays lossless.
    ``topk`` = 0: the full rows (fp32)."""
    q = q.float()
    if topk <= 0 or q.numel() == 0:
        return (q,)
    m = max(1, int((q > 0).sum(dim=-1).max()))
    vals, idx = torch.topk(q, min(m, q.shape[-1]), dim=-1)
    return vals, idx.to(torch.int32)


def unpack_dists(tensors: tuple[torch.Tensor, ...], vocab: int) -> torch.Tensor:
    """Inverse of ``pack_dists``: ``q [γ, V]`` bit for bit."""
    if len(tensors) == 1:
        return tensors[0]
    vals, idx = tensors
    return torch.zeros(vals.shape[0], vocab, dtype=vals.dtype).scatter_(-1, idx.long(), vals)


# ------------------------------------------------------------------------------ a stage
@dataclass
class Stage:
    """One stage process's place in the ring: its model (all layers loaded, only its own cached
    and run), layer range, links to its neighbours, recorder and the run clock."""

    model: Transformer
    layers: tuple[int, int]
    index: int
    count: int
    inbox: Transport | None  # from the previous stage (the first: from the last, verified tokens)
    outbox: Transport | None  # to the next stage (the last: to the first)
    rec: RunRecorder
    now: Callable[[], float]
    compute_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (phase, kind) -> s
    # the first stage's draft reads the target's features (an eagle head): the last stage returns
    # them with its answers to the schedule's windows (the `ar` baseline has no draft)
    features: bool = False
    hidden: torch.Tensor | None = None  # the last forward's output of the final layer (pre-norm)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def name(self) -> str:
        return f"stage{self.index}"

    def compute(self, x: torch.Tensor, start: int, *, head: bool, row: int = 0,
                prefill: bool = False) -> torch.Tensor:
        """This stage's layers on ``x`` (token ids ``[1, T]`` on the first stage, hidden states
        otherwise) written at slots ``start ..`` of KV-cache row ``row``; logits ``[T, V]`` when
        ``head`` (last stage). A prompt (``prefill``) of a row other than 0 is prefilled on row 0
        as when served alone, then copied to its row."""
        m, (lo, hi) = self.model, self.layers
        h = m.embed(x) if self.first else x
        if row == 0 or prefill:
            h = m.forward_layers(h, start, lo=lo, hi=hi)
            if row:
                copy_prefix(m, row, start + h.shape[1])
        else:
            h = layers_rows(m, h, [Feed(row, [0] * h.shape[1], start)], lo=lo, hi=hi)
        if hi == m.args.n_layers:  # kept for an eagle draft: its features (``features_of``)
            self.hidden = h
        return m.head(h)[0] if head else h

    def timed(self, x: torch.Tensor, start: int, *, head: bool, kind: str, phase: int,
              request_id: int, round_idx: int, row: int = 0) -> torch.Tensor:
        """``compute``, recorded as a span of this stage and summed per (phase, prefill or not);
        an empty input (a one-token prompt has nothing to prefill) passes through."""
        if x.numel() == 0:
            return x
        s = self.now()
        out = self.compute(x, start, head=head, row=row, prefill=kind == "prefill")
        e = self.now()
        self.rec.span(self.name, kind, s, e, request_id=request_id, round_idx=round_idx)
        key = (phase, 0 if kind == "prefill" else 1)
        self.compute_s[key] = self.compute_s.get(key, 0.0) + e - s
        return out

    def recv(self) -> Message:
        assert self.inbox is not None
        return self.inbox.recv()  # at most the transport's receive timeout (real.recv_timeout_s)

    def send(self, msg: Message) -> None:
        assert self.outbox is not None
        self.outbox.send(msg)


# -------------------------------------------------------------------- the first stage
def send_prompt(stage: Stage, prompt: list[int], request_id: int, phase: int, row: int = 0) -> None:
    """Feed ``prompt`` (the prompt but its last token) at slots 0.. of ``row`` and pass it on."""
    x = torch.tensor([prompt], device=stage.model.device)
    h = stage.timed(x, 0, head=False, kind="prefill", phase=phase, request_id=request_id, round_idx=-1,
                    row=row)
    if stage.count > 1:
        stage.send(Message(Kind.ACTIVATIONS, request_id=request_id, round=-1, version=phase,
                           committed=0, row=row, tensors=(h, torch.tensor(prompt, dtype=torch.int32))))


def await_prompt(stage: Stage, request_id: int) -> Flow[tuple[float, torch.Tensor | None]]:
    """The last stage's prefill end (run clock; the stage's own time on a one-stage pipeline)
    and the target's features of the fed prompt when the last stage sent them (an eagle draft;
    None on a one-stage pipeline: the draft reads them from this process's target)."""
    if stage.count == 1:
        return stage.now(), None
    msg = yield
    if msg.kind != Kind.DATA or msg.request_id != request_id:
        raise PipelineProtocolError(f"stage0 expected the prefill acknowledgement of request "
                                    f"{request_id}, got kind {msg.kind} request {msg.request_id}")
    return float(msg.tensors[0][0]), (msg.tensors[1] if len(msg.tensors) > 1 else None)


def features_of(stage: Stage, rows: int) -> torch.Tensor:
    """The target's features of the first ``rows`` tokens of this (last) stage's last forward:
    the final layer's output before the final norm, ``[rows, dim]``."""
    m = stage.model
    if rows == 0:  # nothing was fed (a one-token prompt)
        return torch.zeros(0, m.args.dim, dtype=m.dtype, device=m.device)
    if stage.hidden is None or stage.hidden.shape[1] < rows:
        raise PipelineProtocolError(f"{stage.name} has no features of {rows} tokens to return")
    return stage.hidden[0, :rows]


def traverse(stage: Stage, window: list[int], *, committed: int, request_id: int, round_idx: int,
             phase: int, dists: tuple[torch.Tensor, ...] = (), verify: Verify | None = None,
             row: int = 0) -> Flow[tuple[list[int], torch.Tensor | None]]:
    """One round trip from the first stage: feed ``window`` at slots ``committed-1 ..``, send
    it down the pipeline with ``dists``, return the emitted tokens the last stage sends back
    (``verify`` decides here on a one-stage pipeline) and the target's features of the window's
    first len(emitted) positions when it sent them (an eagle draft; None on one stage: the
    draft reads them from this process's target)."""
    tokens = torch.tensor(window, dtype=torch.int32)
    msg = Message(Kind.ACTIVATIONS, request_id=request_id, round=round_idx, version=phase,
                  committed=committed, row=row, tensors=(torch.empty(0), tokens, *dists))
    x = tokens.long().view(1, -1).to(stage.model.device)
    kind = "decode" if phase == BASELINE_PHASE else "verify"
    if stage.count == 1:
        assert verify is not None
        logits = stage.timed(x, committed - 1, head=True, kind=kind, phase=phase,
                             request_id=request_id, round_idx=round_idx, row=row)
        return verify(logits, msg), None
    h = stage.timed(x, committed - 1, head=False, kind=kind, phase=phase, request_id=request_id,
                    round_idx=round_idx, row=row)
    stage.send(replace(msg, tensors=(h, tokens, *dists)))
    got = yield
    emitted = got.tensors[0].tolist() if got.tensors else []
    features = got.tensors[1] if len(got.tensors) > 1 else None
    if (got.kind != Kind.VERIFIED or got.request_id != request_id or got.round != round_idx
            or got.committed != committed + len(emitted)
            or (features is not None and features.shape[0] != len(emitted))):
        raise PipelineProtocolError(
            f"stage0 expected the verified tokens of request {request_id} round {round_idx} after "
            f"{committed} committed tokens, got kind {got.kind} request {got.request_id} round "
            f"{got.round} committing {got.committed} with {len(emitted)} tokens"
            + ("" if features is None else f" and {features.shape[0]} features"))
    return emitted, features


def stop(stage: Stage) -> None:
    """No more requests: tell the next stage (which tells the next)."""
    if stage.count > 1 and not stage.last:
        stage.send(Message(Kind.STOP))


# ------------------------------------------------------------------ stages 1 .. N-1
def stage_worker(stage: Stage, make_verify: Callable[[Message], Verify]) -> int:
    """A stage after the first: run its layers on every window until STOP; the last stage
    verifies (``make_verify(prompt message)`` gives the request's verifier) and answers the
    first. Returns the number of windows served. Windows of several requests may interleave
    (real/runtime/pipelined.py): each is run on its request's row and verified by its verifier."""
    served = 0
    verifiers: dict[tuple[int, int], Verify] = {}  # (phase, request) -> its verifier
    while True:
        msg = stage.recv()
        if msg.kind == Kind.STOP:
            stop(stage)
            return served
        if msg.kind != Kind.ACTIVATIONS:
            raise PipelineProtocolError(f"{stage.name} expected activations, got kind {msg.kind}")
        h = msg.tensors[0]
        prompt = msg.round < 0
        kind = "prefill" if prompt else ("decode" if msg.version == BASELINE_PHASE else "verify")
        start = 0 if prompt else msg.committed - 1
        out = stage.timed(h, start, head=stage.last and not prompt, kind=kind, phase=msg.version,
                          request_id=msg.request_id, round_idx=msg.round, row=msg.row)
        served += 1
        # an eagle draft's features ride back with the answer (not to the `ar` baseline's windows)
        feats = stage.features and msg.version == SCHEDULE_PHASE
        if not stage.last:
            stage.send(replace(msg, tensors=(out, *msg.tensors[1:])))
        elif prompt:
            verifiers[(msg.version, msg.request_id)] = make_verify(msg)
            end = torch.tensor([stage.now()], dtype=torch.float64)
            fed = features_of(stage, msg.tensors[1].numel()) if feats else None
            stage.send(Message(Kind.DATA, request_id=msg.request_id, round=-1, version=msg.version,
                               row=msg.row, tensors=(end,) if fed is None else (end, fed)))
        else:
            verify = verifiers.get((msg.version, msg.request_id))
            if verify is None:
                raise PipelineProtocolError(f"{stage.name} got a window of request {msg.request_id} "
                                            "before its prompt")
            emitted = verify(out, msg)
            tokens = torch.tensor(emitted, dtype=torch.int32)
            tensors = (tokens, features_of(stage, len(emitted))) if feats else (tokens,)
            stage.send(Message(Kind.VERIFIED, request_id=msg.request_id, round=msg.round,
                               version=msg.version, committed=msg.committed + len(emitted),
                               row=msg.row, tensors=tensors))


# ------------------------------------------------------------------------- `ar` on it
def ar_pipeline(stage: Stage, req: RealRequest, eos: frozenset[int], verify: Verify | None,
                *, rec: RunRecorder, phase: int = BASELINE_PHASE) -> list[int]:
    """`ar` over the pipeline for one request served alone (``ar_flow``)."""
    return run_alone(stage, ar_flow(stage, req, eos, verify, rec=rec, phase=phase))


def ar_flow(stage: Stage, req: RealRequest, eos: frozenset[int], verify: Verify | None,
            *, rec: RunRecorder, phase: int = BASELINE_PHASE, row: int = 0) -> Flow[list[int]]:
    """`ar` over the pipeline, first stage's side: every token is one round trip (a window of
    the last token, no guesses). Records rounds and the request in ``rec``."""
    rid, now = req.request_id, stage.now
    ids = list(req.prompt_ids)
    t0 = now()
    send_prompt(stage, ids[:-1], rid, phase, row)
    prefill_end, _ = yield from await_prompt(stage, rid)
    start = now()
    out: list[int] = []
    done, i = False, 0
    while not done:
        s = now()
        emitted, _ = yield from traverse(stage, [ids[-1]], committed=len(ids), request_id=rid,
                                         round_idx=i, phase=phase, verify=verify, row=row)
        e = now()
        ids.extend(emitted)
        out, done = finish(out, emitted, req.max_new_tokens, eos)
        rec.round(request_id=rid, round_idx=i, start_s=s, end_s=e, drafted=0, checked=0, accepted=0,
                  emitted=1, verified_tokens=1, draft_s=0.0, target_s=e - s)
        i += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=prefill_end - t0, decode_s=now() - start, rounds=i))
    return out


def summary_fields(exp: Any) -> dict[str, Any]:
    """Network facts of the run, for summary.json (the simulator's ``Pipeline.summary_fields``)."""
    from testbed.placement import split_layers

    net, n = exp.network, exp.placement.nodes
    return {"latency_ms": net.latency_ms, "jitter_ms": net.jitter_ms,
            "bandwidth_gbit_s": net.bandwidth_gbit_s, "network": net.name,
            "links_per_round_trip": n if n > 1 else 0,
            "stage_layers": "/".join(str(hi - lo) for lo, hi in split_layers(exp.pair.target.layers, n))}
