"""Serving under load over a real pipeline of stage processes (`decentralized`, and `ar` over the
same pipeline): several requests in flight at once, a stage working on one request's window
while a link carries another's. The mirror of sim/runtime/pipelined.py.

The first stage is the server. Requests arrive on the run clock as ``workload.arrival`` says
(real/runtime/batching.py ``WallClockArrivals``), wait in testbed/admission.py's FCFS queue and
are admitted within ``serving.max_batch`` requests in flight and ``serving.kv_budget_tokens``
whenever a request arrives or finishes. Each admitted request gets a KV-cache row, the same on
every stage (``Message.row``), and runs its one-request flow (real/runtime/pipeline.py: a
generator that yields whenever it waits for the last stage's answer): its prompt, then its
windows, each drafted on the first stage when its previous answer is in. The first stage runs one
flow at a time, in the order their answers arrive (new requests first), as the simulator's first
stage is a resource of capacity one taken in turn; the other stages serve windows in the order
they arrive (``stage_worker``), each on its request's row. A receiving thread takes the answers
off the ring while the first stage computes, so a request that arrives while every flow waits is
admitted at once.

Each request drafts from its own generator and draft state (a draft model: its own row of the
draft's KV cache, ``RowModelDraft``; an eagle head: its own row of the head's cache and its own
features, from the last stage's answers, ``RowEagleDraft``), and a row computes what the
one-request row computes, so
every request's output equals its output served alone, at any temperature.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from real.runtime.batching import WallClockArrivals
from real.runtime.context import RealRequest
from real.runtime.links import Message
from real.runtime.pipeline import Flow, PipelineProtocolError, Stage
from testbed.admission import Admission, mark_load
from testbed.recorder import RunRecorder

# a request's flow on its row: (request, row) -> the flow
StartFlow = Callable[[RealRequest, int], Flow[list[int]]]


@dataclass
class InFlight:
    req: RealRequest
    flow: Flow[list[int]]
    row: int
    arrival_s: float
    admit_s: float
    rounds_from: int  # its rounds are recorded from this index on


class Answers:
    """The first stage's receiving thread: one receive per answer a flow waits for (``expect``),
    handed over through a queue so that the server can wait for an answer or the next arrival,
    whichever comes first. Every receive keeps the transport's timeout (``real.recv_timeout_s``):
    a stage that died or hangs ends the run with the transport's one line."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.got: queue.Queue[Message | BaseException] = queue.Queue()
        self.wanted = threading.Semaphore(0)
        self.closing = False
        self.thread = threading.Thread(target=self._receive, name="answers", daemon=True)
        self.thread.start()

    def expect(self) -> None:
        self.wanted.release()

    def _receive(self) -> None:
        while True:
            self.wanted.acquire()
            if self.closing:
                return
            try:
                self.got.put(self.stage.recv())
            except BaseException as e:  # re-raised on the server's thread
                self.got.put(e)
                return

    def next(self, timeout_s: float | None) -> Message | None:
        """The next answer, or None when ``timeout_s`` passes first."""
        try:
            got = self.got.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self) -> None:
        self.closing = True
        self.wanted.release()
        self.thread.join(timeout=5)


def serve_pipelined(stage: Stage, exp: Any, requests: list[RealRequest], start: StartFlow, *,
                    rec: RunRecorder, rows: int) -> list[list[int]]:
    """Admit and serve every request through its flow (``start``), several in flight, on KV-cache
    rows 1..``rows`` (row 0 is the prefill row); their outputs in the order of ``requests``."""
    if stage.count < 2:
        raise ValueError("a pipeline serves requests in flight over two stages or more")
    admission = Admission(exp)
    arrivals = WallClockArrivals(exp, requests, admission, stage.now)
    free = list(range(rows, 0, -1))
    flying: dict[int, InFlight] = {}
    ready: deque[tuple[int, Message | None]] = deque()  # flows to resume, with their answers
    outputs: dict[int, list[int]] = {}
    answers = Answers(stage)
    try:
        while len(outputs) < len(requests):
            arrivals.poll()
            for req, arrived in admission.admit(len(flying)):
                row = free.pop()
                flying[req.request_id] = InFlight(req, start(req, row), row, arrived, stage.now(), len(rec.rounds))
                ready.append((req.request_id, None))  # in turn, as the simulator's stage queue
            if ready:
                rid, answer = ready.popleft()
                a = flying[rid]
                try:
                    a.flow.send(answer)  # type: ignore[arg-type]
                    answers.expect()
                except StopIteration as done:
                    outputs[rid] = done.value
                    mark_load(rec, rid, arrival=a.arrival_s, admit=a.admit_s, finish=stage.now(),
                              rounds_from=a.rounds_from)
                    del flying[rid]
                    free.append(a.row)
                    admission.release(a.req)
                    arrivals.done()
                continue
            if not flying:
                time.sleep(arrivals.wait_s())  # idle until the next arrival
                continue
            answer = answers.next(arrivals.wait_s() if arrivals.timed else None)
            if answer is not None:
                if answer.request_id not in flying:
                    raise PipelineProtocolError(f"stage0 got an answer for request {answer.request_id}, "
                                                f"which is not in flight ({sorted(flying)} are)")
                ready.append((answer.request_id, answer))
    finally:
        answers.close()
    return [outputs[r.request_id] for r in requests]
