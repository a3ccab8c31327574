"""Typed messages between ranks, with the ``network=`` delay applied off the compute path.

The mirror of ``sim/runtime/links.py``. A ``Message`` is a fixed header — kind, request id, round,
version, committed length, send and arrival time, the request's KV-cache row, and per tensor its
dtype and shape — plus up to
``MAX_TENSORS`` tensors (at most ``MAX_DIMS`` dimensions each). On the wire the header is one
int64 tensor of ``testbed.links.HEADER_INTS`` fields, followed by the tensors.

A ``Transport`` is one rank's end of a channel (a set of ranks with its own process group):

- ``send(msg, dst)`` returns at once. The message is copied, stamped with the send time, given
  its arrival time by the link's ``testbed.links.LinkDelays`` (the simulator's delay model and
  seeded draws: latency + payload bytes / bandwidth on a FIFO wire + exponential jitter) and
  handed to the sender thread, which releases messages in order of arrival time — so compute
  never waits for the emulated wire, bandwidth serialises, and jitter may reorder messages
  exactly as the simulator lets them overtake. Links inside one machine are not emulated
  (``LinkSpec.emulated`` is false): the physical transport is what is measured.
  The emulated delay is the *total* delay: the physical transport underneath costs time too
  (~1 ms per frame on loopback gloo), so each message is handed over that much before its
  arrival time — ``DistTransport.measure_lead`` measures the one-way cost of a frame when the
  channel is set up, and the sender thread learns its own wake-up lateness as it runs.
- ``recv(src=None, timeout_s=None)`` blocks until the next message arrives, at most the
  transport's receive timeout (``real.recv_timeout_s``), then raises ``LinkTimeout`` naming both
  ranks, their roles and the channel. It records one timeline span per message (resource = the
  link name, kind ``link``, from the send to the arrival), in the simulator's format.

Two implementations: ``DistTransport`` (torch.distributed point-to-point on the channel's
process group: gloo for CPU tensors, NCCL for CUDA ones; one fixed-size frame per message when
the tensors fit in ``FRAME_BYTES``) and ``LoopbackTransport`` (in-process queues, for protocol
tests that need no processes: ``LoopbackTransport.connect``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from testbed.links import HEADER_BYTES, HEADER_INTS, LinkDelays
from testbed.placement import LinkSpec
from testbed.recorder import RunRecorder

MAGIC, MAGIC_SPLIT = 0x5BEC, 0x5BED  # tensors inside the frame / sent after it
FRAME_BYTES = 32 * 1024  # one DistTransport frame: header + tensors that fit
MAX_TENSORS, MAX_DIMS = 4, 3
NO_TIME = -(1 << 63)  # header value of an unset send time
LEAD_PROBES, LEAD_GAP_S = 12, 0.008  # per emulated link when a channel is set up
WAKEUP_WINDOW, MAX_WAKEUP_S = 64, 2e-3  # the sender thread's wake-up lateness estimate
_FIXED = 10  # magic, kind, request, round, version, committed, sent_ns, n_tensors, row, arrival_ns
assert _FIXED + MAX_TENSORS * (2 + MAX_DIMS) == HEADER_INTS
DTYPES: dict[int, torch.dtype] = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16,
                                  4: torch.int32, 5: torch.int64, 6: torch.uint8, 7: torch.bool,
                                  8: torch.float64, 9: torch.int16, 10: torch.int8}
CODES = {dt: code for code, dt in DTYPES.items()}


class Kind(IntEnum):
    """Message kinds of the schedules (a schedule may use any int; these name the common ones)."""

    DATA = 0
    DRAFT = 1  # a chain of draft tokens (+ distributions)
    TREE = 2  # a selected subtree: (token, position, parent) int32 rows (+ distributions)
    VERIFIED = 3  # tokens emitted by the target
    ACTIVATIONS = 4  # hidden states between pipeline stages
    STOP = 5  # no more work: the peer may finish


class LinkError(RuntimeError):
    """A message could not be sent or received (the peer is gone, or a malformed header)."""


class LinkTimeout(LinkError):
    """No message arrived within the receive timeout."""


@dataclass(frozen=True)
class Message:
    kind: int
    request_id: int = -1
    round: int = -1
    version: int = 0  # e.g. the tree version a batch was selected from
    committed: int = 0  # e.g. tokens committed to the output so far
    row: int = 0  # the request's KV-cache row on every rank (0: the one-request row; under load 1..)
    tensors: tuple[torch.Tensor, ...] = ()
    sent_s: float = math.nan  # set by the transport: send time on the run clock
    # set by the sender's thread when it hands the message over (``Transport._arrival``): its
    # arrival on the run clock over an emulated link, which a busy receiver may take later
    arrival_s: float = math.nan

    @property
    def payload_bytes(self) -> int:
        """Bytes charged by the delay model (the header is framing: see testbed.links)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def encode_header(msg: Message, *, inline: bool = True) -> torch.Tensor:
    if len(msg.tensors) > MAX_TENSORS:
        raise ValueError(f"a message carries at most {MAX_TENSORS} tensors, got {len(msg.tensors)}")
    h = [MAGIC if inline else MAGIC_SPLIT, int(msg.kind), msg.request_id, msg.round, msg.version, msg.committed,
         round(msg.sent_s * 1e9) if math.isfinite(msg.sent_s) else NO_TIME, len(msg.tensors), msg.row,
         round(msg.arrival_s * 1e9) if math.isfinite(msg.arrival_s) else NO_TIME]
    for t in msg.tensors:
        if t.dim() > MAX_DIMS or t.dtype not in CODES:
            raise ValueError(f"tensor of shape {tuple(t.shape)} and dtype {t.dtype}: at most "
                             f"{MAX_DIMS} dims and one of {sorted(map(str, CODES))}")
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        h += [CODES[t.dtype], t.dim(), *shape]
    h += [0] * (HEADER_INTS - len(h))
    return torch.tensor(h, dtype=torch.int64)


def decode_header(h: torch.Tensor) -> tuple[Message, list[tuple[torch.dtype, tuple[int, ...]]], bool]:
    """(message without tensors, the tensors' (dtype, shape), whether they are inline)."""
    v = h.tolist()
    if v[0] not in (MAGIC, MAGIC_SPLIT) or not 0 <= v[7] <= MAX_TENSORS:
        raise LinkError(f"malformed message header {v[:8]}: sender and receiver disagree on the protocol")
    specs = []
    for i in range(v[7]):
        code, ndim, *shape = v[_FIXED + i * (2 + MAX_DIMS): _FIXED + (i + 1) * (2 + MAX_DIMS)]
        specs.append((DTYPES[code], tuple(shape[:ndim])))
    sent = math.nan if v[6] == NO_TIME else v[6] * 1e-9
    arrival = math.nan if v[9] == NO_TIME else v[9] * 1e-9
    return Message(v[1], v[2], v[3], v[4], v[5], v[8], (), sent, arrival), specs, v[0] == MAGIC


@dataclass(order=True)
class _Pending:
    due_s: float
    seq: int
    dst: int = field(compare=False)
    msg: Message = field(compare=False)


class Transport(ABC):
    """One rank's end of a channel. Subclasses move whole messages (``_put`` / ``_get``)."""

    def __init__(self, *, channel: str, rank: int, names: Mapping[int, str],
                 links: Mapping[tuple[int, int], LinkSpec], seed: int, clock: Callable[[], float],
                 recv_timeout_s: float, rec: RunRecorder | None = None) -> None:
        self.channel, self.rank, self.names = channel, rank, dict(names)
        self.links = dict(links)
        self.delays = {key: LinkDelays(spec.model, seed) for key, spec in self.links.items()
                       if spec.emulated}
        self.clock, self.recv_timeout_s, self.rec = clock, recv_timeout_s, rec
        self.peers = tuple(r for r in self.names if r != rank)
        self._heap: list[_Pending] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._closed = False
        self.release_lateness_s: list[float] = []  # per message: hand-over time - due time
        # per link: the physical one-way cost of a frame, subtracted from the emulated delay
        self.lead_s: dict[tuple[int, int], float] = {}
        self._wakeups: list[float] = []  # recent wake-up lateness of the sender thread
        self._wakeup_s = 0.0  # their median: the sender thread wakes up that much early
        self._thread = threading.Thread(target=self._release, name=f"send {channel}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ subclass interface
    @abstractmethod
    def _put(self, msg: Message, dst: int) -> None: ...

    @abstractmethod
    def _get(self, src: int | None, timeout_s: float) -> tuple[int, Message]: ...

    # ------------------------------------------------------------------------- public API
    def describe(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def link_name(self, src: int, dst: int) -> str:
        spec = self.links.get((src, dst))
        return spec.name if spec is not None else f"link rank{src}->rank{dst}"

    def _peer(self, rank: int | None) -> int | None:
        if rank is None and len(self.peers) == 1:
            return self.peers[0]
        if rank is not None and rank not in self.peers:
            raise ValueError(f"rank {rank} is not a peer on channel {self.channel} (peers {self.peers})")
        return rank

    def send(self, msg: Message, dst: int | None = None) -> None:
        """Queue ``msg`` for ``dst`` (default: the only peer); returns at once."""
        dst = self._peer(dst)
        if dst is None:
            raise ValueError(f"channel {self.channel} has several peers: name the destination")
        self._raise_pending()
        now = self.clock()
        msg = replace(msg, sent_s=now, tensors=tuple(t.detach().clone() for t in msg.tensors))
        d = self.delays.get((self.rank, dst))
        due = d.deliver(now, msg.payload_bytes).arrival_s if d is not None else now
        if d is not None:  # hand over early by the physical transport's own cost
            due = max(now, due - self.lead_s.get((self.rank, dst), 0.0))
        self._enqueue(due, dst, msg)

    def recv(self, src: int | None = None, timeout_s: float | None = None) -> Message:
        """The next message (from ``src``, default: any peer); ``LinkTimeout`` after the timeout."""
        src = self._peer(src)
        timeout = self.recv_timeout_s if timeout_s is None else timeout_s
        try:
            got, msg = self._get(src, timeout)
        except LinkTimeout:
            who = self.describe(src) if src is not None else "any peer"
            raise LinkTimeout(f"{self.describe(self.rank)} got no message from {who} on channel "
                              f"{self.channel} within {timeout:g} s (real.recv_timeout_s)") from None
        except LinkError:
            raise
        except RuntimeError as e:
            who = self.describe(src) if src is not None else "a peer"
            raise LinkError(f"{self.describe(self.rank)} lost {who} on channel {self.channel}: "
                            f"{str(e).splitlines()[0][:200]}") from None
        if self.rec is not None:  # the link's span ends at the arrival, not when a busy receiver took it
            end = self.clock()
            if math.isfinite(msg.arrival_s):
                end = max(msg.sent_s, min(end, msg.arrival_s))
            self.rec.span(self.link_name(got, self.rank), "link", msg.sent_s, end,
                          request_id=msg.request_id, round_idx=msg.round)
        return msg

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued message has been handed to the peer."""
        deadline = time.monotonic() + (self.recv_timeout_s if timeout_s is None else timeout_s)
        with self._cv:
            while self._inflight and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkTimeout(f"{self.describe(self.rank)} could not deliver "
                                      f"{self._inflight} message(s) on channel {self.channel}")
                self._cv.wait(left)
        self._raise_pending()

    def close(self) -> None:
        """Flush, then stop the sender thread."""
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------------ internals
    def _raise_pending(self) -> None:
        if self._error is not None:
            raise LinkError(f"{self.describe(self.rank)} could not send on channel {self.channel}: "
                            f"{str(self._error).splitlines()[0][:200]}")

    def _enqueue(self, due_s: float, dst: int, msg: Message) -> None:
        with self._cv:
            heapq.heappush(self._heap, _Pending(due_s, next(self._seq), dst, msg))
            self._inflight += 1
            self._cv.notify()

    def _learn_wakeup(self, due_s: float, slept: bool) -> None:
        """Record how late the hand-over is; the thread then wakes up early by the median of the
        recent lateness of hand-overs it slept for (one already due when the thread got to it —
        no delay, or queued behind another — says nothing about waking up)."""
        late = self.clock() - due_s
        self.release_lateness_s.append(late)
        if slept:
            self._wakeups.append(late + self._wakeup_s)
            del self._wakeups[:-WAKEUP_WINDOW]
            self._wakeup_s = min(max(0.0, sorted(self._wakeups)[len(self._wakeups) // 2]), MAX_WAKEUP_S)

    def _arrival(self, item: _Pending, slept: bool) -> float:
        """When a message handed over now arrives, for its link span: the hand-over plus the
        link's physical cost when the thread slept until it was due; its due time when it was
        already due, i.e. the thread was still handing over earlier messages (a point-to-point
        send completes only when the receiver takes it: a busy receiver, not the link, held it
        back). Unknown (nan) on a link that is not emulated: its span ends at the receipt."""
        key = (self.rank, item.dst)
        if key not in self.delays:
            return math.nan
        return (self.clock() if slept else item.due_s) + self.lead_s.get(key, 0.0)

    def _release(self) -> None:
        """Sender thread: hand each message over at its arrival time, earliest first."""
        while True:
            slept = False
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0].due_s - self._wakeup_s
                                            > self.clock()):
                    slept = bool(self._heap)
                    self._cv.wait(None if not self._heap
                                  else self._heap[0].due_s - self._wakeup_s - self.clock())
                if self._closed:
                    return
                item = heapq.heappop(self._heap)
            self._learn_wakeup(item.due_s, slept)
            try:
                self._put(replace(item.msg, arrival_s=self._arrival(item, slept)), item.dst)
            except BaseException as e:  # reported to the caller on its next send/flush
                self._error = e
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
            if self._error is not None:
                return


class DistTransport(Transport):
    """Point-to-point over a torch.distributed process group (ranks are global ranks).

    One message is one fixed-size *frame* (``FRAME_BYTES``: the header, then the tensors'
    bytes, 8-byte aligned) whenever the tensors fit, so the receiver can post its receive before
    it knows the sizes; larger payloads follow the frame as one send per tensor. (Two gloo sends
    back to back cost 1-2 ms more per round trip than one on loopback TCP: measured in
    benchmarks/bench_transport.py.)"""

    def __init__(self, *, group: dist.ProcessGroup | None, device: torch.device | str = "cpu",
                 **kw) -> None:  # type: ignore[no-untyped-def]
        self.group, self.device = group, torch.device(device)
        super().__init__(**kw)

    def measure_lead(self, probes: int = LEAD_PROBES, gap_s: float = LEAD_GAP_S,
                     ) -> dict[tuple[int, int], float]:
        """Measure each emulated link's physical one-way cost and make it the link's lead.

        Every rank of the channel calls this at set-up, in the same order. The sender sends
        ``probes`` frames, one every ``gap_s`` (so the receiver is blocked in its receive, as it
        is behind a WAN link: a ping-pong, with both ends hot, underestimates the cost by half);
        the receiver times each on the shared run clock and returns the median."""
        probe = Message(Kind.DATA, tensors=(torch.zeros(8, dtype=torch.int32),))
        for src, dst in sorted(self.links):
            if not self.links[(src, dst)].emulated or self.rank not in (src, dst):
                continue
            if self.rank == src:
                for _ in range(probes):  # through the sender thread, as every message goes
                    time.sleep(gap_s)
                    now = self.clock()
                    self._enqueue(now, dst, replace(probe, sent_s=now))
                self.flush()
                _, answer = self._get(dst, self.recv_timeout_s)
                self.lead_s[(src, dst)] = float(answer.tensors[0])
            else:
                one_way = []
                for _ in range(probes):
                    _, m = self._get(src, self.recv_timeout_s)
                    one_way.append(self.clock() - m.sent_s)
                median = max(0.0, sorted(one_way)[len(one_way) // 2])
                self._put(Message(Kind.DATA, tensors=(torch.tensor(median, dtype=torch.float64),)), src)
        return dict(self.lead_s)

    def _put(self, msg: Message, dst: int) -> None:
        tensors = [t.contiguous().to(self.device) for t in msg.tensors]
        inline = _inline_size(tensors) <= FRAME_BYTES
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        frame[:HEADER_BYTES] = encode_header(msg, inline=inline).to(self.device).view(torch.uint8)
        if inline:
            off = HEADER_BYTES
            for t in tensors:
                n = t.numel() * t.element_size()
                frame[off:off + n] = t.reshape(-1).view(torch.uint8)
                off += _aligned(n)
        dist.send(frame, dst, group=self.group)
        if not inline:
            for t in tensors:
                dist.send(t, dst, group=self.group)

    def _wait(self, work: dist.Work, timeout_s: float) -> None:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise LinkTimeout(str(e)) from None
            raise

    def _get(self, src: int | None, timeout_s: float) -> tuple[int, Message]:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        work = dist.irecv(frame, src=src, group=self.group)
        self._wait(work, timeout_s)
        if src is None:
            src = work._source_rank()  # gloo: the sender of an any-source receive
        msg, specs, inline = decode_header(frame[:HEADER_BYTES].view(torch.int64).cpu())
        tensors = []
        off = HEADER_BYTES
        for dtype, shape in specs:
            if inline:
                n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                t = frame[off:off + n].view(dtype).reshape(shape).clone()
                off += _aligned(n)
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self._wait(dist.irecv(t, src=src, group=self.group), timeout_s)
            tensors.append(t)
        return src, replace(msg, tensors=tuple(tensors))


def _aligned(n: int) -> int:
    return (n + 7) // 8 * 8


def _inline_size(tensors: list[torch.Tensor]) -> int:
    return HEADER_BYTES + sum(_aligned(t.numel() * t.element_size()) for t in tensors)
