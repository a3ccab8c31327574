"""Message cost over the bridge of `schedule=async` on this host (`+calibrate`): the draft group's
subtree reaching the target group while the draft computes.

real/calibrate/links.py times raw gloo sends between two idle, unpinned processes (the α–β of the
transport itself). An async run sends otherwise: through the testbed's own transport
(real.runtime.links: a frame, then one send per large tensor, handed over by a sender thread) from a
draft pinned to one core that starts its next expansions right after sending, to a target
pinned to the other core that waits for the subtree. On this host that costs several times
the raw figure (a 1.5 MB subtree with the draft's q at temperature 1: ~3.8 ms in the runs, 0.65
ms by the raw α–β): the sender's threads get the busy core only when the scheduler preempts the
compute.

``measure_bridge`` launches exactly that layout (`schedule=async`, one core per group) and, per
message size, has the draft send a message and compute for ``busy_s`` (torch matmuls, one
thread), the target timing each message from its send (``sent_s`` on the run clock all workers
share) to its receipt. The profile keeps ``links["bridge"] = {"bytes", "seconds", "alpha_s",
"beta_s_per_byte", "busy_s", "transport"}``; sim/cost/profile.py turns it into the bridge's link
model for simulated async runs (``ProfileCost.bridge_link``).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from testbed.config import ExperimentConfig


@dataclass
class BridgeGrid:
    bytes: list[int] = field(default_factory=lambda: [64, 16_384, 262_144, 1_048_576, 2_097_152])
    repeats: int = 15  # per size, sizes interleaved; the median is kept
    busy_s: float = 0.03  # the draft computes this long after each send (a few expansions)


def bridge_worker(ctx: Any, grid_d: dict[str, Any]) -> dict[int, list[float]] | None:
    """One rank (module level: spawned workers import it): the draft sends and computes, the
    target receives and returns {bytes: [one-way seconds]}."""
    from real.runtime.links import Kind, Message

    grid = BridgeGrid(**grid_d)
    if ctx.role == "draft":
        out = ctx.transport_to("target")
        back = ctx.transport_from("target")
        # a forward streams its weights: matrix-vector products over 32 MB, as memory-bound
        w, x = torch.randn(2048, 4096), torch.randn(4096)
        for _ in range(grid.repeats):
            for size in grid.bytes:
                payload = torch.zeros(max(1, size // 4), dtype=torch.float32)
                out.send(Message(Kind.DATA, tensors=(payload,)))
                end = time.perf_counter() + grid.busy_s
                while time.perf_counter() < end:  # the draft's next expansions
                    x = torch.tanh(w.T @ (w @ x) * 1e-3)
                back.recv()  # the target has it: next message
        out.flush()
        return None
    inbox, reply = ctx.transport_from("draft"), ctx.transport_to("draft")
    times: dict[int, list[float]] = {}
    for _ in range(grid.repeats):
        for size in grid.bytes:
            msg = inbox.recv()
            times.setdefault(size, []).append(ctx.now() - msg.sent_s)
            reply.send(Message(Kind.DATA))
    reply.flush()
    return times


def bridge_table(raw: dict[int, list[float]], grid: BridgeGrid) -> dict[str, Any]:
    """Medians per size and their α–β fit (real/calibrate/links.alpha_beta_fit)."""
    from real.calibrate.links import alpha_beta_fit

    return {"transport": "real.runtime.links.DistTransport (gloo, loopback), draft computing after each send",
            **alpha_beta_fit({b: statistics.median(raw[b]) for b in grid.bytes}), "busy_s": grid.busy_s}


def measure_bridge(exp: ExperimentConfig, grid: BridgeGrid | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Launch the async layout's two pinned workers and measure (module docstring)."""
    from real.runtime.launch import launch

    grid = grid or BridgeGrid()
    e = copy.deepcopy(exp)
    e.backend = "real"
    e.schedule.name, e.schedule.tree = "async", True
    e.placement.target_gpus = e.placement.draft_gpus = 1
    e.network.latency_ms = e.network.jitter_ms = 0.0  # (the bridge is intra-node: not emulated)
    started = time.perf_counter()
    results = launch(e, bridge_worker, args=(asdict(grid),))
    raw = next(r.value for r in results if r.value is not None)
    table = bridge_table(raw, grid)
    log("bridge: " + " ".join(f"{b}B={1e3 * s:.2f}ms" for b, s in zip(table["bytes"], table["seconds"]))
        + f" (α {1e3 * table['alpha_s']:.2f} ms, {time.perf_counter() - started:.1f} s)")
    return table
