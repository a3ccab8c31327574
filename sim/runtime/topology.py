"""Who runs where and which links join them, as a networkx graph built from the placement.

The placement itself (groups, ranks, layer ranges, links) is ``testbed.placement``, shared with
the real backend; this module binds it to a SimPy environment. Graph nodes are *GPU groups*: a
model (or a pipeline stage of one) on k GPUs of one machine, with attributes ``machine`` (index
of the node/server), ``gpus``, ``role`` (draft | target) and ``layers`` (the target's half-open
layer range for a pipeline stage). Directed edges carry a ``Link`` (sim.runtime.links) in attribute
``link``:

- groups on the same machine talk over NVLink (``hardware.nvlink_latency_us``, ``nvlink_gbps``);
- groups on different machines over the network of ``network=`` (``latency_ms``,
  ``bandwidth_gbit_s``, gigabits per second, with 0 = unlimited, ``jitter_ms``).

Layouts (``testbed.placement.layout``):

- ``two_groups`` (``async``): groups ``target`` and ``draft`` on disjoint GPUs of machine 0, an NVLink each way.
- ``pipeline`` (``decentralized``, and ``ar`` with ``placement.nodes > 1``): the target as
  ``placement.nodes`` stages ``stage0..stage{N-1}`` on machines 0..N-1, layers split as evenly as
  possible (the first ``L mod N`` stages get one more); the draft (node ``draft``,
  ``placement.draft_gpus``) shares machine 0's GPUs with stage 0 (no link between them). Links
  ``stage i -> stage i+1`` carry activations, and ``stage N-1 -> stage 0`` returns the verified
  tokens, closing the loop: one round trip crosses N links.
- otherwise (``single``, ``tree``) one group ``target`` (the draft shares its GPUs): no links.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import simpy

from sim.runtime.links import Link
from testbed.config import ExperimentConfig
from testbed.placement import Placement, layout, link_name, make_placement, split_layers, stage_name
from testbed.recorder import RunRecorder
from testbed.schedules import PIPELINE

__all__ = ["Topology", "build_topology", "layout", "link_name", "split_layers", "stage_name"]


@dataclass
class Topology:
    graph: nx.DiGraph
    placement: Placement

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


def build_topology(exp: ExperimentConfig, env: simpy.Environment,
                   rec: RunRecorder | None = None) -> Topology:
    pl = make_placement(exp)
    g = nx.DiGraph()
    for grp in pl.groups:
        g.add_node(grp.name, machine=grp.machine, gpus=len(grp.ranks), role=grp.role,
                   layers=grp.layers)
    if pl.layout == PIPELINE:  # the draft shares stage 0's machine and GPUs
        g.add_node("draft", machine=0, gpus=exp.placement.draft_gpus, role="draft", layers=None)
    for lk in pl.links:
        g.add_edge(lk.src, lk.dst, link=Link.of(env, lk.model, exp.seed, rec))
    return Topology(g, pl)
