"""Who runs where and which links join them, as a networkx graph built from the experiment.

Graph nodes are *GPU groups*: a model (or a pipeline stage of one) on k GPUs of one machine,
with attributes ``machine`` (index of the node/server), ``gpus``, ``role`` (draft | target) and
``layers`` (the target's half-open layer range for a pipeline stage). Directed edges carry a
``Link`` (sim.links) in attribute ``link``:

- groups on the same machine talk over NVLink (``hardware.nvlink_latency_us``, ``nvlink_gbps``);
- groups on different machines over the network of ``network=`` (``latency_ms``,
  ``bandwidth_gbps`` with 0 = unlimited, ``jitter_ms``).

Layouts (``layout(exp)``):

- ``async``: groups ``draft`` and ``target`` on disjoint GPUs of machine 0, an NVLink each way.
- ``decentralized`` (and ``ar`` with ``placement.nodes > 1``): the target as a pipeline of
  ``placement.nodes`` stages ``stage0..stage{N-1}`` on machines 0..N-1, layers split as evenly as
  possible (the first ``L mod N`` stages get one more); the draft shares machine 0's GPUs with
  stage 0 (no link between them). Links ``stage i -> stage i+1`` carry activations, and
  ``stage N-1 -> stage 0`` returns the verified tokens, closing the loop: one round trip
  crosses N links.
- otherwise one group ``target`` (the draft, if any, shares its GPUs): no links.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import simpy

from sim.links import Link, bandwidth_Bps
from testbed.config import ExperimentConfig
from testbed.recorder import RunRecorder


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) per stage, sizes differing by at most one (larger stages first)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    base, extra = divmod(layers, stages)
    out, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def stage_name(i: int) -> str:
    return f"stage{i}"


def link_name(u: str, v: str) -> str:
    return f"link {u}->{v}"


@dataclass
class Topology:
    graph: nx.DiGraph

    def link(self, u: str, v: str) -> Link:
        return self.graph.edges[u, v]["link"]

    def links(self) -> list[Link]:
        return [d["link"] for _, _, d in self.graph.edges(data=True)]

    def stages(self) -> list[str]:
        return sorted((n for n, d in self.graph.nodes(data=True) if d.get("layers") is not None),
                      key=lambda n: self.graph.nodes[n]["layers"][0])

    def ring(self) -> list[Link]:
        """The links of one pipeline round trip, in order (stage0 -> ... -> stage0)."""
        st = self.stages()
        if len(st) < 2:
            return []
        return [self.link(a, b) for a, b in zip(st, st[1:] + st[:1])]


def layout(exp: ExperimentConfig) -> str:
    if exp.schedule.name == "async":
        return "async"
    if exp.schedule.name == "decentralized" or exp.placement.nodes > 1:
        return "pipeline"
    return "single"


def _make_link(env: simpy.Environment, exp: ExperimentConfig, u: str, v: str, same_machine: bool,
               rec: RunRecorder | None) -> Link:
    name = link_name(u, v)
    if same_machine:
        hw = exp.hardware
        return Link(env, name, hw.nvlink_latency_us * 1e-6, bandwidth_Bps(hw.nvlink_gbps), 0.0,
                    exp.seed, rec)
    net = exp.network
    return Link(env, name, net.latency_ms * 1e-3, bandwidth_Bps(net.bandwidth_gbps),
                net.jitter_ms * 1e-3, exp.seed, rec)


def build_topology(exp: ExperimentConfig, env: simpy.Environment,
                   rec: RunRecorder | None = None) -> Topology:
    g = nx.DiGraph()
    pl = exp.placement
    kind = layout(exp)
    if kind == "async":
        g.add_node("target", machine=0, gpus=pl.target_gpus, role="target", layers=None)
        g.add_node("draft", machine=0, gpus=pl.draft_gpus, role="draft", layers=None)
        for u, v in (("draft", "target"), ("target", "draft")):
            g.add_edge(u, v, link=_make_link(env, exp, u, v, True, rec))
    elif kind == "pipeline":
        spans = split_layers(exp.pair.target.layers, pl.nodes)
        names = [stage_name(i) for i in range(pl.nodes)]
        for i, (name, lay) in enumerate(zip(names, spans)):
            g.add_node(name, machine=i, gpus=pl.target_gpus, role="target", layers=lay)
        g.add_node("draft", machine=0, gpus=pl.draft_gpus, role="draft", layers=None)
        if pl.nodes > 1:
            for u, v in zip(names, names[1:] + names[:1]):
                g.add_edge(u, v, link=_make_link(env, exp, u, v, False, rec))
    else:
        g.add_node("target", machine=0, gpus=pl.target_gpus, role="target", layers=None)
    return Topology(g)
