"""The multi-process part of `+calibrate`: what `sim.cost_model=profile` needs to predict runs
whose groups span several devices (cores here).

Measured in one ``real.runtime.launch.launch`` of two workers, each pinned to its core with one
intra-op thread (exactly how a TP 2 run executes):

- per model (the target and the pair's draft model), forward latency against tokens per forward
  k and cache context c, at TP 1 (rank 0 alone, rank 1 parked in a barrier) and TP 2 (both ranks,
  ``real.model.tp.apply_tp`` with ``real.allreduce``), for two input shapes:
  ``chain`` — k tokens, causal (decode, sync's draft steps and verification);
  ``tree`` — k tree nodes with an explicit tree mask over c prefix/tree slots plus the k new ones
  (what real/model/tree_tokens.py feeds: a draft expansion of w leaves over prefix + tree slots, a
  target verification of bs nodes), which takes the masked attention path instead of the
  causal one;
- all-reduce latency against message size, for the shared-memory and the gloo backends;
- the round trip of a message between the two workers (gloo send/recv on loopback) against size.

Probes are timed in interleaved passes like real/calibrate/profile.py's (a neighbour's burst spoils one
sample of many probes); TP 2 probes run in the same shuffled order on both ranks (same seed).
Tables are smoothed the same way (Theil–Sen in context, isotonic in k); raw medians are kept.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from testbed.config import ExperimentConfig, real_dtype
from testbed.paths import repo_path

SHAPES = ("chain", "tree")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TpGrid:
    k: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    context: list[int] = field(default_factory=lambda: [64, 256, 640])
    degrees: list[int] = field(default_factory=lambda: [1, 2])
    repeats: int = 7  # interleaved passes; the median is kept
    allreduce_floats: list[int] = field(default_factory=lambda: [576, 4608, 36864, 147456, 589824])
    message_bytes: list[int] = field(default_factory=lambda: [4, 1024, 16384, 262144, 1048576])
    message_repeats: int = 30

    @classmethod
    def quick(cls) -> TpGrid:
        """A tiny grid for tests and smoke runs."""
        return cls(k=[1, 4], context=[16, 48], repeats=2, allreduce_floats=[64, 4096],
                   message_bytes=[4, 4096], message_repeats=4)


def tree_mask(k: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [k, context + k], depths [k]) of k nodes of a binary tree over ``context`` slots:
    every node sees the whole context, its ancestors and itself."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, k)]
    mask = torch.zeros(k, context + k, dtype=torch.bool)
    mask[:, :context] = True
    depths = torch.zeros(k, dtype=torch.long)
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, context + j] = True
            j = parents[j]
        depths[i] = 0 if parents[i] < 0 else depths[parents[i]] + 1
    return mask, depths


def _forward_fn(model: Any, shape: str, *, k: int, context: int, gen: torch.Generator) -> Callable[[], Any]:
    x = torch.randint(model.args.vocab_size, (1, k), generator=gen)
    pos = torch.arange(context, context + k)
    if shape == "chain":
        return lambda: model(x, input_pos=pos)
    mask, depths = tree_mask(k, context)
    return lambda: model(x, input_pos=pos, mask=mask, position_ids=context + depths)


class PassTimer:
    """Every probe once per pass, in a shuffled order that is the same on every rank."""

    def __init__(self) -> None:
        self.fns: dict[tuple, Callable[[], Any]] = {}
        self.samples: dict[tuple, list[float]] = {}

    def run(self, passes: int, seed: int, align: Callable[[], Any] | None = None) -> None:
        """``align`` (not timed) before every timed call: at TP > 1 the group's barrier, so that
        both ranks start each forward together and the leader's time is the group's (a leader
        that ran behind timed only its own share: k = 2 read slower than k = 4 at TP 2)."""
        keys = sorted(self.fns)
        for key in keys:
            self.fns[key]()  # warm-up
        rng = random.Random(seed)
        for _ in range(passes):
            rng.shuffle(keys)
            for key in keys:
                if align is not None:
                    align()
                t = time.perf_counter()
                self.fns[key]()
                self.samples.setdefault(key, []).append(time.perf_counter() - t)

    def median(self, key: tuple) -> float:
        return statistics.median(self.samples[key])


def _load(path: str | None, dtype: torch.dtype, max_seq: int) -> Any:
    from real.model.weights import load_model

    return load_model(None if path is None else repo_path(path), dtype=dtype, max_seq=max_seq)[0]


def _allreduce_latency(backend: Any, floats: list[int], repeats: int) -> dict[str, list]:
    out = []
    for n in floats:
        x = torch.ones(n)
        for _ in range(5):
            backend(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            backend(x)
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times))
    return {"bytes": [4 * n for n in floats], "seconds": out}


def _round_trips(rank: int, sizes: list[int], repeats: int) -> dict[str, list]:
    from real.calibrate.links import round_trip_s

    return {"bytes": list(sizes), "seconds": [round_trip_s(rank, size, repeats) for size in sizes]}


def tp_worker(ctx: Any, models: dict[str, str | None], grid_d: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of the measurement (module level: spawned workers import it). ``models``: name ->
    weights path (None = the bundled GGUF). Returns the raw medians on rank 0, None elsewhere."""
    from real.model.tp import apply_tp
    from specbed_kernels.allreduce import make

    grid = TpGrid(**grid_d)
    exp = ctx.exp
    rank, group = ctx.info.index, ctx.tp_group()
    dtype = DTYPES[real_dtype(exp)]
    max_seq = max(grid.context) + max(grid.k) + 8
    gen = torch.Generator().manual_seed(7)
    result: dict[str, Any] = {"forward": {}, "allreduce": {}, "round_trip": {}}
    with torch.inference_mode():
        for degree in grid.degrees:
            for name, path in models.items():
                timer = PassTimer()
                if degree == 1 and rank != 0:
                    dist.barrier(group=group)  # parked while rank 0 measures TP 1 alone
                    continue
                model = _load(path, dtype, max_seq)
                if degree > 1:
                    apply_tp(model, rank=rank, world=degree, group=group, allreduce=exp.real.allreduce)
                for shape in SHAPES:
                    for c in grid.context:
                        for k in grid.k:
                            timer.fns[(shape, k, c)] = _forward_fn(model, shape, k=k, context=c, gen=gen)
                timer.run(grid.repeats, seed=degree,
                          align=(lambda: dist.barrier(group=group)) if degree > 1 else None)
                result["forward"][(name, degree)] = {key: timer.median(key) for key in timer.fns}
                if degree == 1:
                    dist.barrier(group=group)
                del model
        dist.barrier(group=group)
        for kind in ("shm", "gloo"):
            backend = make(kind, group)
            result["allreduce"][kind] = _allreduce_latency(backend, grid.allreduce_floats, grid.message_repeats)
            if hasattr(backend, "close"):
                dist.barrier(group=group)
                backend.close()
        result["round_trip"]["gloo_loopback"] = _round_trips(rank, grid.message_bytes, grid.message_repeats)
    return result if rank == 0 else None


def tp_tables(raw: dict[tuple, float], grid: TpGrid) -> dict[str, Any]:
    """{shape: {"k", "context", "seconds" (smoothed), "raw"}} of one model at one degree."""
    from real.calibrate.fit import smooth_table

    out = {}
    for shape in SHAPES:
        table = [[raw[(shape, k, c)] for k in grid.k] for c in grid.context]
        out[shape] = {"k": grid.k, "context": grid.context, "seconds": smooth_table(table, grid.context),
                      "raw": table}
    return out


def measure_tp(exp: ExperimentConfig, models: dict[str, str | None], grid: TpGrid | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Launch two pinned workers and measure; returns the profile's additions:
    ``{"models": {name: {"tp": {degree: tables}}}, "allreduce": ..., "links": {"round_trip": ...}}``."""
    from real.runtime.launch import launch

    grid = grid or TpGrid()
    e = copy.deepcopy(exp)
    e.backend = "real"
    e.real.recv_timeout_s = 900.0  # rank 1 waits in a barrier while rank 0 measures TP 1 alone
    e.schedule.name, e.schedule.tree = "sync", True  # the tree layout: both models on every rank
    e.placement.target_gpus = e.placement.draft_gpus = max(grid.degrees)
    started = time.perf_counter()
    log(f"tensor-parallel tables: {', '.join(models)} at TP {grid.degrees}, "
        f"{len(grid.k) * len(grid.context) * len(SHAPES)} shapes x {grid.repeats} passes")
    results = launch(e, tp_worker, args=(models, asdict(grid)))
    raw = next(r.value for r in results if r.value is not None)
    tables: dict[str, Any] = {}
    for (name, degree), probes in raw["forward"].items():
        tables.setdefault(name, {})[str(degree)] = tp_tables(probes, grid)
    for name, by_degree in tables.items():
        for degree, t in by_degree.items():
            for shape in SHAPES:
                row = t[shape]["seconds"][0]
                log(f"{name} TP{degree} {shape} context={grid.context[0]}: "
                    + " ".join(f"k{k}={1e3 * v:.1f}" for k, v in zip(grid.k, row)) + " ms")
    for kind, t in raw["allreduce"].items():
        log(f"all-reduce {kind}: " + " ".join(f"{b}B={1e6 * s:.0f}" for b, s in zip(t["bytes"], t["seconds"])) + " µs")
    rt = raw["round_trip"]["gloo_loopback"]
    log("round trip (gloo loopback): " + " ".join(f"{b}B={1e6 * s:.0f}" for b, s in zip(rt["bytes"], rt["seconds"])) + " µs")
    return {"models": {name: {"tp": t} for name, t in tables.items()},
            "allreduce": {kind: {**t, "world": max(grid.degrees)} for kind, t in raw["allreduce"].items()},
            "round_trip": {"gloo_loopback": {**rt, "transport": "torch.distributed gloo send/recv, 127.0.0.1"}},
            "tp_allreduce": exp.real.allreduce, "tp_calibration_s": round(time.perf_counter() - started, 1)}
