"""Links between GPU groups or pipeline stages: latency, bandwidth, jitter, as a SimPy resource.

The delay model is ``testbed.links`` (one implementation, shared with ``real/runtime/links.py``): a
message of ``nbytes`` bytes first *serializes* onto the link, holding it for
``nbytes / bandwidth`` (capacity 1: messages in the same direction queue behind each other),
then *propagates* for ``latency + jitter`` without holding it (the next message may already be
serializing, as on a real wire). Its one-way time is therefore

    latency + nbytes / bandwidth + jitter      (+ queueing behind earlier messages)

``bandwidth = inf`` (config value 0) makes serialization free. Jitter is exponential with mean
``jitter`` drawn per message, in send order, from the link's ``testbed.links.LinkDelays`` stream
seeded by (experiment seed, link name): the real backend draws the same values for the same
messages. ``transfer_time`` gives the expected one-way time of an unqueued message (jitter at
its mean excluded: it is the deterministic part; ``mean_time`` includes it).

A link records one timeline span per message (resource = the link name, kind ``link``), from
the start of serialization to the arrival.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from testbed.links import LinkDelays, LinkModel, bandwidth_Bps
from testbed.recorder import RunRecorder

__all__ = ["Link", "bandwidth_Bps"]

class Link:
    """One direction of a point-to-point link (full duplex = two Links)."""

    __slots__ = ("env", "model", "delays", "rec", "wire", "messages", "bytes_sent", "busy_s")

    def __init__(self, env: simpy.Environment, name: str, latency_s: float, bandwidth_Bps: float, *,
                 jitter_s: float = 0.0, seed: int = 0, rec: RunRecorder | None = None) -> None:
        self.model = LinkModel(name, latency_s, bandwidth_Bps, jitter_s)
        self.delays = LinkDelays(self.model, seed)
        self.env, self.rec = env, rec
        self.wire = simpy.Resource(env, capacity=1)
        self.messages, self.bytes_sent, self.busy_s = 0, 0, 0.0

    @classmethod
    def of(cls, env: simpy.Environment, model: LinkModel, seed: int = 0,
           rec: RunRecorder | None = None) -> Link:
        return cls(env, model.name, model.latency_s, model.bandwidth_Bps, jitter_s=model.jitter_s, seed=seed,
                   rec=rec)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def latency_s(self) -> float:
        return self.model.latency_s

    @property
    def bandwidth_Bps(self) -> float:
        return self.model.bandwidth_Bps

    @property
    def jitter_s(self) -> float:
        return self.model.jitter_s

    def __repr__(self) -> str:
        return f"Link({self.model})"

    def serialization_time(self, nbytes: float) -> float:
        return self.model.serialization_s(nbytes)

    def transfer_time(self, nbytes: float) -> float:
        """Expected one-way time of an unqueued message, without jitter."""
        return self.model.transfer_s(nbytes)

    def mean_time(self, nbytes: float) -> float:
        """Mean one-way time of an unqueued message, jitter included."""
        return self.model.mean_s(nbytes)

    def jitter(self) -> float:
        return self.delays.jitter()

    def send(self, nbytes: float, request_id: int = -1, round_idx: int = -1,
             ) -> Generator[Any, Any, float]:
        """SimPy process body: deliver one message; returns its one-way time. Use it as
        ``yield from link.send(n)`` to wait for the arrival, or ``env.process(link.send(n))``."""
        env = self.env
        start = env.now
        ser = nbytes / self.model.bandwidth_Bps
        if ser > 0.0:
            with self.wire.request() as req:
                yield req
                yield env.timeout(ser)
        # drawn after the wire is released: FIFO, so message i still gets draw i (as in real)
        delay = self.delays.propagation()
        if delay > 0.0:
            yield env.timeout(delay)
        self.messages += 1
        self.bytes_sent += nbytes
        self.busy_s += env.now - start
        if self.rec is not None:
            self.rec.span(self.name, "link", start, env.now, request_id=request_id, round_idx=round_idx)
        return env.now - start

