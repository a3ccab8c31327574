"""The target as a pipeline of layer ranges over nodes joined by links (DSD's setting, seed 003).

One *traversal* runs a forward of k tokens through every stage in order (stage i computes its
layers, then ships k x hidden activations to stage i+1 over its link); the last stage produces
the logits, and ``send_back`` returns the resulting tokens from the last node to the first (the
node that embeds the next input and hosts the draft). A round trip therefore crosses N links.
An eagle draft reads the target's features, which only the last node computes: they travel back
with the tokens (``send_back``) and, after the prompt, alone (``send_prompt_answer``), charged as
real/runtime/pipeline.py sends them (testbed.links.dsd_verified_bytes, dsd_prompt_answer_bytes).

``ar_pipeline`` is the `ar` schedule over such a pipeline (used by sim/schedules/ar.py when
``placement.nodes > 1``): every token makes a full round trip.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from sim.cost.quant import spec
from sim.runtime.context import SimContext, SimRequest
from sim.runtime.links import Link
from sim.runtime.topology import Topology, build_topology
from testbed.arrivals import under_load
from testbed.links import TOKEN_BYTES, dsd_prompt_answer_bytes, dsd_verified_bytes, dsd_window_bytes
from testbed.recorder import RequestRecord
from testbed.schedules import spec_of

__all__ = ["TOKEN_BYTES", "Pipeline", "ar_pipeline", "topology_for"]


def topology_for(ctx: SimContext) -> Topology:
    """The run's topology, built once per simulation (links live as long as the environment)."""
    topo = ctx.state.get("topology")
    if topo is None:
        topo = ctx.state["topology"] = build_topology(ctx.exp, ctx.env, ctx.rec)
    return topo


class Pipeline:
    """Stages, their layer ranges and links, bound to one simulation."""

    def __init__(self, ctx: SimContext) -> None:
        topo = topology_for(ctx)
        g = topo.graph
        self.ctx = ctx
        self.names = topo.stages()
        self.layers: list[tuple[int, int]] = [g.nodes[n]["layers"] for n in self.names]
        self.hops: list[Link] = [topo.link(a, b) for a, b in zip(self.names, self.names[1:])]
        self.back: Link | None = topo.link(self.names[-1], self.names[0]) if len(self.names) > 1 else None
        t = ctx.exp.pair.target
        self.hidden, self.act_bytes = t.hidden, spec(t.quant).act_bytes
        self.act_bytes_per_token = t.hidden * self.act_bytes
        # an eagle draft on the first node reads the verified tokens' features: the last node sends
        # them back (not in the `ar` baseline's pipeline: it has no draft)
        self.back_features = spec_of(ctx.exp).drafts and ctx.exp.pair.draft.kind == "eagle"
        # under load, several requests share the stages: each a resource of capacity one
        # (sim/runtime/pipelined.py); one request at a time needs none
        self.stages: list[simpy.Resource] | None = [simpy.Resource(ctx.env, 1) for _ in self.names] \
            if under_load(ctx.exp.workload) else None

    @classmethod
    def of(cls, ctx: SimContext) -> Pipeline:
        pipe = ctx.state.get("pipeline")
        if pipe is None:
            pipe = ctx.state["pipeline"] = cls(ctx)
        return pipe

    @property
    def nodes(self) -> int:
        return len(self.names)

    @property
    def links_per_round_trip(self) -> int:
        return len(self.hops) + (1 if self.back is not None else 0)

    def compute_s(self, tokens: int, context: int) -> float:
        """Target compute of one traversal, all stages together (no communication)."""
        fwd = self.ctx.cost.forward
        return sum(fwd("target", tokens, context, lay) for lay in self.layers)

    def hop_mean_s(self, tokens: int = 1) -> float:
        """Mean one-way time of one hop carrying `tokens` tokens of activations (unqueued)."""
        if not self.hops:
            return 0.0
        return sum(h.mean_time(tokens * self.act_bytes_per_token) for h in self.hops) / len(self.hops)

    def forward(self, tokens: int, context: int, request_id: int, round_idx: int, *,
                kind: str, dists_bytes: int = 0, draft_s: float = 0.0) -> Generator[Any, Any, float]:
        """Run `tokens` tokens through every stage; returns the compute seconds spent. Each hop
        carries what real/runtime/pipeline.py sends: activations, the tokens' ids and ``dists_bytes`` of
        draft distributions (testbed.links.dsd_window_bytes). ``draft_s``: the window's draft,
        on the first node's devices right before its stage-0 forward, in one hold of them (the
        real first stage drafts and runs its layers back to back, real/runtime/pipelined.py)."""
        env, rec, fwd = self.ctx.env, self.ctx.rec, self.ctx.cost.forward
        nbytes = dsd_window_bytes(tokens, hidden=self.hidden, act_bytes=self.act_bytes, dists=dists_bytes)
        compute = 0.0
        last = len(self.names) - 1
        for i, (name, lay) in enumerate(zip(self.names, self.layers)):
            dt = fwd("target", tokens, context, lay)
            lead = draft_s if i == 0 else 0.0
            s = yield from self.on_stage(i, lead + dt)
            if lead:
                rec.span("draft", "draft", s, s + lead, request_id=request_id, round_idx=round_idx)
            rec.span(name, kind, s + lead, env.now, request_id=request_id, round_idx=round_idx)
            compute += dt
            if i < last:
                yield from self.hops[i].send(nbytes, request_id, round_idx)
        return compute

    def on_stage(self, i: int, dt: float) -> Generator[Any, Any, float]:
        """Hold stage ``i``'s devices for ``dt`` seconds (waiting for them under load); returns
        when the work started. The first node's draft runs here with ``i = 0``."""
        env = self.ctx.env
        if self.stages is None:
            s = env.now
            yield env.timeout(dt)
            return s
        with self.stages[i].request() as hold:
            yield hold
            s = env.now
            yield env.timeout(dt)
        return s

    def send_back(self, ntokens: int, request_id: int, round_idx: int) -> Generator[Any, Any, None]:
        """The last node returns `ntokens` token ids to the first (with their features for an
        eagle draft)."""
        if self.back is not None:
            nbytes = dsd_verified_bytes(ntokens, hidden=self.hidden, act_bytes=self.act_bytes,
                                        features=self.back_features)
            yield from self.back.send(nbytes, request_id, round_idx)

    def send_prompt_answer(self, fed: int, request_id: int) -> Generator[Any, Any, None]:
        """The last node's answer to a prompt of which it fed `fed` tokens: with the features an
        eagle draft reads. (Other drafts' first window does not wait for it: not modelled.)"""
        if self.back is not None and self.back_features:
            nbytes = dsd_prompt_answer_bytes(fed, hidden=self.hidden, act_bytes=self.act_bytes,
                                             features=True)
            yield from self.back.send(nbytes, request_id, -1)

    def summary_fields(self) -> dict[str, Any]:
        """Network facts of the run, for summary.json."""
        net = self.ctx.exp.network
        return {"latency_ms": net.latency_ms, "jitter_ms": net.jitter_ms,
                "bandwidth_gbit_s": net.bandwidth_gbit_s, "network": net.name,
                "links_per_round_trip": self.links_per_round_trip,
                "stage_layers": "/".join(str(hi - lo) for lo, hi in self.layers)}


def ar_pipeline(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    """`ar` over the pipeline: each token is one traversal plus the return of its id."""
    env, rec = ctx.env, ctx.rec
    pipe = Pipeline.of(ctx)
    seq = ctx.oracle.sequence(req.request_id, req.prompt_len)
    rid = req.request_id
    t0 = env.now
    yield from pipe.forward(req.prompt_len, 0, rid, -1, kind="prefill")
    prefill_s = env.now - t0
    start = env.now
    kv = req.prompt_len - 1  # the last prompt token is fed by the first decode forward
    out: list[int] = []
    for i in range(req.max_new_tokens):
        s = env.now
        compute = yield from pipe.forward(1, kv, rid, i, kind="decode")
        out.append(seq.ar_token())
        yield from pipe.send_back(1, rid, i)
        kv += 1
        rec.round(request_id=rid, round_idx=i, start_s=s, end_s=env.now, drafted=0, checked=0,
                  accepted=0, emitted=1, verified_tokens=1, draft_s=0.0, target_s=compute)
    ids = out if ctx.oracle.produces_ids else []
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=ids, generated=len(out), prefill_s=prefill_s, decode_s=env.now - start,
        rounds=req.max_new_tokens))
    ctx.extra.update(pipe.summary_fields())
