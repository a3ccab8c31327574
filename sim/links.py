"""Links between GPU groups or pipeline stages: latency, bandwidth, jitter, as a SimPy resource.

A message of ``nbytes`` bytes first *serializes* onto the link, holding it for
``nbytes / bandwidth`` (capacity 1: messages in the same direction queue behind each other), then
*propagates* for ``latency + jitter`` without holding it (the next message may already be
serializing, as on a real wire). Its one-way time is therefore

    latency + nbytes / bandwidth + jitter      (+ queueing behind earlier messages)

``bandwidth = inf`` (config value 0) makes serialization free. Jitter is drawn per message from
an **exponential distribution with mean ``jitter``** (≥ 0, memoryless, a light model of
queueing in routers), from the link's own ``random.Random`` seeded by (experiment seed, link
name), so a run is reproducible and adding a link does not change the draws of the others.
``transfer_time`` gives the expected one-way time of an unqueued message (jitter at its mean
excluded: it is the deterministic part; ``mean_time`` includes it).

A link records one timeline span per message (resource = the link name, kind ``link``), from
the start of serialization to the arrival.
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator
from typing import Any

import simpy

from testbed.recorder import RunRecorder


class Link:
    """One direction of a point-to-point link (full duplex = two Links)."""

    __slots__ = ("env", "name", "latency_s", "bandwidth_Bps", "jitter_s", "rng", "rec", "wire",
                 "messages", "bytes_sent", "busy_s")

    def __init__(self, env: simpy.Environment, name: str, latency_s: float, bandwidth_Bps: float,
                 jitter_s: float = 0.0, seed: int = 0, rec: RunRecorder | None = None) -> None:
        if latency_s < 0 or jitter_s < 0 or not bandwidth_Bps > 0:
            raise ValueError(f"link {name}: latency {latency_s}, jitter {jitter_s} must be >= 0 "
                             f"and bandwidth {bandwidth_Bps} > 0 (inf for unlimited)")
        self.env, self.name, self.rec = env, name, rec
        self.latency_s, self.bandwidth_Bps, self.jitter_s = latency_s, bandwidth_Bps, jitter_s
        # str seeds are hashed with SHA-512 by random.Random: stable across processes
        self.rng = random.Random(f"{seed}:{name}")
        self.wire = simpy.Resource(env, capacity=1)
        self.messages, self.bytes_sent, self.busy_s = 0, 0, 0.0

    def __repr__(self) -> str:
        bw = "inf" if math.isinf(self.bandwidth_Bps) else f"{self.bandwidth_Bps / 1e9:g} GB/s"
        return (f"Link({self.name}: {self.latency_s * 1e3:g} ms, {bw}, "
                f"jitter exp(mean {self.jitter_s * 1e3:g} ms))")

    def serialization_time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps

    def transfer_time(self, nbytes: float) -> float:
        """Expected one-way time of an unqueued message, without jitter."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def mean_time(self, nbytes: float) -> float:
        """Mean one-way time of an unqueued message, jitter included."""
        return self.transfer_time(nbytes) + self.jitter_s

    def jitter(self) -> float:
        return self.rng.expovariate(1.0 / self.jitter_s) if self.jitter_s > 0 else 0.0

    def send(self, nbytes: float, request_id: int = -1, round_idx: int = -1,
             ) -> Generator[Any, Any, float]:
        """SimPy process body: deliver one message; returns its one-way time. Use it as
        ``yield from link.send(n)`` to wait for the arrival, or ``env.process(link.send(n))``."""
        env = self.env
        start = env.now
        ser = nbytes / self.bandwidth_Bps
        if ser > 0.0:
            with self.wire.request() as req:
                yield req
                yield env.timeout(ser)
        delay = self.latency_s + (self.jitter() if self.jitter_s > 0 else 0.0)
        if delay > 0.0:
            yield env.timeout(delay)
        self.messages += 1
        self.bytes_sent += nbytes
        self.busy_s += env.now - start
        if self.rec is not None:
            self.rec.span(self.name, "link", start, env.now, request_id, round_idx)
        return env.now - start


def bandwidth_Bps(gbps: float) -> float:
    """Config GB/s -> bytes/s; 0 means unlimited."""
    return gbps * 1e9 if gbps > 0 else math.inf
