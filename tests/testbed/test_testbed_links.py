"""testbed.links: the one delay model of both backends, and the message sizes."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import simpy

from sim.runtime.links import Link
from testbed.links import (
    HEADER_BYTES,
    LinkDelays,
    LinkModel,
    activation_bytes,
    draft_window_bytes,
    subtree_message_bytes,
    tokens_bytes,
    wire_bytes,
)

WAN = LinkModel("link stage0->stage1", 0.020, 0.125e9, 0.002)


def _sim_arrivals(model: LinkModel, seed: int, sends: list[tuple[float, int]]) -> list[float]:
    """Arrival times of messages handed to a simulated link at the given (time, bytes)."""
    env = simpy.Environment()
    link = Link.of(env, model, seed)
    out: dict[int, float] = {}

    def one(i: int, at: float, n: int):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield from link.send(n)
        out[i] = env.now

    for i, (at, n) in enumerate(sends):
        env.process(one(i, at, n))
    env.run()
    return [out[i] for i in range(len(sends))]


@pytest.mark.parametrize("seed", [0, 7])
def test_same_seed_same_delays_as_the_simulator(seed: int) -> None:
    # back-to-back sends of mixed sizes: some queue behind the previous one on the wire
    sends = [(0.001 * i, 1_000_000 if i % 3 == 0 else 48) for i in range(60)]
    sim = _sim_arrivals(WAN, seed, sends)
    delays = LinkDelays(WAN, seed)
    real = [delays.deliver(at, n).arrival_s for at, n in sends]
    assert real == pytest.approx(sim, abs=1e-12)
    other = LinkDelays(WAN, seed + 1)
    assert [other.deliver(at, n).arrival_s for at, n in sends] != pytest.approx(sim, abs=1e-9)


def test_deliver_serialises_fifo_and_draws_exponential_jitter() -> None:
    d = LinkDelays(LinkModel("l", 0.010, 1000.0), seed=0)
    a, b = d.deliver(0.0, 10), d.deliver(0.0, 10)  # 10 ms serialisation each, in order
    assert (a.start_s, a.on_wire_s, a.arrival_s) == pytest.approx((0.0, 0.010, 0.020))
    assert (b.start_s, b.arrival_s) == pytest.approx((0.010, 0.030))
    jit = LinkDelays(LinkModel("j", 0.0, math.inf, 0.002), seed=3)
    draws = [jit.deliver(0.0, 0).arrival_s for _ in range(5000)]
    assert min(draws) >= 0.0 and statistics.mean(draws) == pytest.approx(0.002, rel=0.06)
    assert WAN.quantile_s(0, 0.5) == pytest.approx(0.020 + 0.002 * math.log(2))
    assert WAN.mean_s(125_000) == pytest.approx(0.020 + 0.001 + 0.002)


def test_message_sizes() -> None:
    assert tokens_bytes(5) == 20
    assert draft_window_bytes(4) == 16 and draft_window_bytes(4, vocab=10) == 16 + 160
    batch = SimpleNamespace(tokens=[5, 6, 7], children=[[1, 2], [], []])  # a root and two children
    assert subtree_message_bytes(batch, vocab=10, sampled=False) == 3 * 12 + 16
    assert subtree_message_bytes(batch, vocab=10, sampled=True) == 3 * 12 + 16 + 40  # q at the root
    assert activation_bytes(3, 576, 4) == 3 * 576 * 4
    assert wire_bytes(100) == HEADER_BYTES + 100


def test_bad_link_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel("l", 0.0, 0.0)
    with pytest.raises(ValueError, match="latency"):
        LinkModel("l", -1.0)
