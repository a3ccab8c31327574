"""Links (latency, bandwidth, jitter as a SimPy resource) and the networkx topology."""

from __future__ import annotations

import math
import statistics

import pytest
import simpy

from sim.runtime.links import Link, bandwidth_Bps
from sim.runtime.topology import build_topology, split_layers
from testbed.recorder import RunRecorder
from tests.conftest import compose_exp


def _arrivals(link: Link, sizes: list[float], at: float = 0.0) -> list[float]:
    env = link.env
    out: list[float] = []

    def one(n: float):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield from link.send(n)
        out.append(env.now)

    for n in sizes:
        env.process(one(n))
    env.run()
    return out


def test_transfer_time_is_latency_plus_serialization() -> None:
    link = Link(simpy.Environment(), "l", 0.010, 1000.0)
    assert link.transfer_time(50) == pytest.approx(0.010 + 0.05)
    assert link.mean_time(50) == link.transfer_time(50)  # no jitter
    assert _arrivals(link, [50]) == [pytest.approx(0.060)]


def test_messages_serialize_on_bandwidth_but_propagate_in_parallel() -> None:
    # two 10-byte messages at 1000 B/s: serialization 10 ms each, one after the other; the
    # 10 ms latency of the first overlaps the serialization of the second
    link = Link(simpy.Environment(), "l", 0.010, 1000.0)
    assert sorted(_arrivals(link, [10, 10])) == [pytest.approx(0.020), pytest.approx(0.030)]
    assert link.messages == 2 and link.bytes_sent == 20


def test_unlimited_bandwidth_costs_latency_only() -> None:
    assert bandwidth_Bps(0) == math.inf
    link = Link(simpy.Environment(), "l", 0.020, bandwidth_Bps(0))
    assert _arrivals(link, [1e9, 1e9]) == [pytest.approx(0.020)] * 2


def test_jitter_is_exponential_nonnegative_and_seeded() -> None:
    def delays(seed: int) -> list[float]:
        link = Link(simpy.Environment(), "wan", 0.020, math.inf, jitter_s=0.005, seed=seed)
        return [link.jitter() for _ in range(4000)]

    d = delays(3)
    assert min(d) >= 0.0
    assert statistics.mean(d) == pytest.approx(0.005, rel=0.06)
    assert statistics.median(d) == pytest.approx(0.005 * math.log(2), rel=0.08)  # exponential
    assert d == delays(3) and d != delays(4)
    # the delay of a message is latency + its jitter draw
    link = Link(simpy.Environment(), "wan", 0.020, math.inf, jitter_s=0.005, seed=3)
    assert _arrivals(link, [8]) == [pytest.approx(0.020 + delays(3)[0])]


def test_link_records_a_span_per_message() -> None:
    rec = RunRecorder()
    link = Link(simpy.Environment(), "link a->b", 0.001, 1e6, rec=rec)
    _arrivals(link, [1000, 1000])
    assert [s[:2] for s in rec.spans] == [("link a->b", "link")] * 2
    assert [round(s[3], 6) for s in rec.spans] == [0.002, 0.003]


def test_bad_link_values_are_rejected() -> None:
    with pytest.raises(ValueError):
        Link(simpy.Environment(), "l", -1.0, 1.0)
    with pytest.raises(ValueError):
        Link(simpy.Environment(), "l", 0.0, 0.0)


@pytest.mark.parametrize("layers,stages", [(80, 3), (32, 8), (28, 5), (7, 7), (10, 1)])
def test_split_layers_is_even_and_complete(layers: int, stages: int) -> None:
    spans = split_layers(layers, stages)
    sizes = [hi - lo for lo, hi in spans]
    assert len(spans) == stages and spans[0][0] == 0 and spans[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_pipeline_topology_is_a_ring_of_network_links() -> None:
    exp = compose_exp("schedule=decentralized", "hardware=a800_nodes", "network=wan",
                      "placement.nodes=4", "network.latency_ms=30", "pair=llama3_8b+llama3_2_1b")
    topo = build_topology(exp, simpy.Environment())
    g = topo.graph
    assert topo.stages() == ["stage0", "stage1", "stage2", "stage3"]
    assert [g.nodes[s]["layers"] for s in topo.stages()] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert g.nodes["draft"]["machine"] == g.nodes["stage0"]["machine"] == 0
    ring = topo.ring()
    assert [lk.name for lk in ring] == ["link stage0->stage1", "link stage1->stage2",
                                        "link stage2->stage3", "link stage3->stage0"]
    assert all(lk.latency_s == pytest.approx(0.030) for lk in ring)
    assert all(lk.bandwidth_Bps == pytest.approx(0.125e9) and lk.jitter_s == pytest.approx(0.002)
               for lk in ring)


def test_async_topology_uses_nvlink_and_single_has_no_links() -> None:
    exp = compose_exp("schedule=async", "placement.target_gpus=5", "placement.draft_gpus=3")
    topo = build_topology(exp, simpy.Environment())
    assert {(u, v) for u, v in topo.graph.edges} == {("draft", "target"), ("target", "draft")}
    nv = topo.link("draft", "target")
    assert nv.latency_s == pytest.approx(exp.hardware.nvlink_latency_us * 1e-6)
    assert nv.bandwidth_Bps == pytest.approx(exp.hardware.nvlink_gbps * 1e9)
    assert topo.graph.nodes["draft"]["gpus"] == 3 and topo.graph.nodes["target"]["gpus"] == 5
    single = build_topology(compose_exp("schedule=sync"), simpy.Environment())
    assert single.graph.number_of_edges() == 0
