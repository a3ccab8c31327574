"""The in-process transport (SGLang's fake transport for protocol tests): the endpoints of a
channel are queues in one process, with the links' emulated delays and timeouts of
``real.runtime.links.Transport``, so the stage and bridge protocols run on threads, no processes."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping

from real.runtime.links import LinkTimeout, Message, Transport
from testbed.placement import LinkSpec
from testbed.recorder import RunRecorder


class LoopbackTransport(Transport):
    """In-process transport over queues (SGLang-style fake transport for protocol tests)."""

    def __init__(self, *, inboxes: Mapping[int, queue.Queue], **kw) -> None:  # type: ignore[no-untyped-def]
        self.inboxes = inboxes
        self._stash: list[tuple[int, Message]] = []
        super().__init__(**kw)

    @classmethod
    def connect(cls, channel: str, ranks: tuple[int, ...], *,
                links: Mapping[tuple[int, int], LinkSpec] | None = None, seed: int = 0,
                clock: Callable[[], float] = time.perf_counter, recv_timeout_s: float = 10.0,
                names: Mapping[int, str] | None = None, rec: RunRecorder | None = None,
                ) -> dict[int, LoopbackTransport]:
        """One endpoint per rank of a channel, all in this process."""
        inboxes: dict[int, queue.Queue] = {r: queue.Queue() for r in ranks}
        names = dict(names) if names else {r: f"rank {r}" for r in ranks}
        return {r: cls(inboxes=inboxes, channel=channel, rank=r, names=names, links=links or {},
                       seed=seed, clock=clock, recv_timeout_s=recv_timeout_s, rec=rec) for r in ranks}

    def _put(self, msg: Message, dst: int) -> None:
        self.inboxes[dst].put((self.rank, msg))

    def _get(self, src: int | None, timeout_s: float) -> tuple[int, Message]:
        for i, (s, _m) in enumerate(self._stash):
            if src is None or s == src:
                return self._stash.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                s, m = self.inboxes[self.rank].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LinkTimeout("loopback receive timed out") from None
            if src is None or s == src:
                return s, m
            self._stash.append((s, m))
