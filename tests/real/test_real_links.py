"""real/runtime/links.py over the in-process loopback transport: protocol, delays, timeouts, spans."""

from __future__ import annotations

import math
import time

import pytest
import torch

from real.runtime.links import (
    MAX_WAKEUP_S,
    Kind,
    LinkTimeout,
    Message,
    decode_header,
    encode_header,
)
from real.runtime.loopback import LoopbackTransport
from testbed.links import LinkDelays, LinkModel
from testbed.placement import LinkSpec
from testbed.recorder import RunRecorder


def test_header_round_trip_keeps_fields_dtypes_and_shapes() -> None:
    msg = Message(Kind.TREE, request_id=3, round=7, version=2, committed=41, row=5, sent_s=1.5,
                  arrival_s=1.75,
                  tensors=(torch.zeros(5, 3, dtype=torch.int32), torch.ones(5, 10), torch.tensor(2)))
    back, specs, inline = decode_header(encode_header(msg))
    assert inline
    assert (back.kind, back.request_id, back.round, back.version, back.committed, back.row) == (2, 3, 7, 2, 41, 5)
    assert back.sent_s == pytest.approx(1.5) and back.arrival_s == pytest.approx(1.75)
    assert specs == [(torch.int32, (5, 3)), (torch.float32, (5, 10)), (torch.int64, ())]
    with pytest.raises(ValueError, match="at most"):
        encode_header(Message(Kind.DATA, tensors=(torch.zeros(1, 1, 1, 1),)))


def test_loopback_delivers_in_order_copies_and_records_spans() -> None:
    rec = RunRecorder()
    link = LinkSpec("link draft->target", "draft", "target", LinkModel("link draft->target", 0.0), False)
    ends = LoopbackTransport.connect("bridge:draft<->target", (0, 1), links={(1, 0): link}, rec=rec,
                                     names={0: "rank 0 (target)", 1: "rank 1 (draft)"})
    buf = torch.arange(4, dtype=torch.int32)
    for r in range(3):
        ends[1].send(Message(Kind.DRAFT, request_id=0, round=r, tensors=(buf,)))
        buf.add_(10)  # the message was copied: later writes to the buffer do not leak into it
    got = [ends[0].recv() for _ in range(3)]
    assert [m.round for m in got] == [0, 1, 2]
    assert [m.tensors[0].tolist() for m in got] == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    ends[0].send(Message(Kind.VERIFIED, tensors=(torch.tensor([5, 6], dtype=torch.int32),)))
    assert ends[1].recv(src=0).tensors[0].tolist() == [5, 6]
    assert [s[:2] for s in rec.spans] == [("link draft->target", "link")] * 3 + [("link rank0->rank1", "link")]
    assert all(s[3] >= s[2] for s in rec.spans)
    with pytest.raises(LinkTimeout, match=r"rank 0 \(target\) got no message from rank 1 \(draft\) on "
                                          r"channel bridge:draft<->target within 0.05 s"):
        ends[0].recv(timeout_s=0.05)
    for e in ends.values():
        e.close()


def test_a_link_span_ends_at_the_arrival_when_the_receiver_takes_the_message_later() -> None:
    """Under load a stage may be busy when a message arrives: the link's span is the link's
    (send to arrival), the wait for the receiver is not charged to it."""
    rec = RunRecorder()
    model = LinkModel("link stage0->stage1", 0.010)
    spec = LinkSpec(model.name, "stage0", "stage1", model, True)
    ends = LoopbackTransport.connect("stage:stage0->stage1", (0, 1), links={(0, 1): spec}, rec=rec)
    ends[0].send(Message(Kind.ACTIVATIONS, round=0, tensors=(torch.zeros(4),)))
    time.sleep(0.060)  # the receiver is busy for 60 ms; the message arrived after ~10
    got = ends[1].recv()
    spans = rec.frames()[2]
    assert len(spans) == 1
    took = float(spans.end_s.iloc[0] - spans.start_s.iloc[0])
    assert 0.009 <= took < 0.040 and got.arrival_s - got.sent_s == pytest.approx(took)
    for e in ends.values():
        e.close()


def test_emulated_link_releases_at_the_modelled_time_without_blocking_the_sender() -> None:
    model = LinkModel("link stage0->stage1", 0.030, 1e6, 0.002)  # 30 ms, 1 MB/s, 2 ms jitter
    spec = LinkSpec(model.name, "stage0", "stage1", model, True)
    ends = LoopbackTransport.connect("stage:stage0->stage1", (0, 1), links={(0, 1): spec}, seed=5)
    sizes = [4000, 40, 4000]  # 4 ms, 0.04 ms, 4 ms on the wire, FIFO
    t0 = time.perf_counter()
    for i, n in enumerate(sizes):
        ends[0].send(Message(Kind.ACTIVATIONS, round=i, tensors=(torch.zeros(n, dtype=torch.uint8),)))
    assert time.perf_counter() - t0 < 0.02  # send() only queues (not a speed assertion: 30 ms away)
    got, arrived = [], []
    for _ in sizes:
        got.append(ends[1].recv())
        arrived.append(time.perf_counter())
    # released in order of arrival time (jitter may reorder, as in the simulator), each no
    # earlier than the shared delay model says, less the sender thread's learnt wake-up lead
    expected = LinkDelays(model, seed=5)
    by_round = {m.round: m for m in got}
    due = {i: expected.deliver(by_round[i].sent_s, n).arrival_s for i, n in enumerate(sizes)}
    assert [m.round for m in got] == sorted(due, key=due.get)
    assert all(arrived[k] >= due[m.round] - MAX_WAKEUP_S for k, m in enumerate(got))
    assert all(math.isfinite(m.sent_s) for m in got)
    for e in ends.values():
        e.close()
