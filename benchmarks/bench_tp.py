"""Tensor-parallel forward latency on CPU cores: TP=2 on 2 pinned cores against TP=1 on one.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tp.py [--models target draft] [--k 1 4 8]
        [--repeats 3] [--iters 10] [--context 128] [--cpus 0 1] [--dtype fp32|bf16] [--out FILE.json]

Two worker processes, each pinned to one core with one intra-op thread, joined by gloo. First
the bare all-reduce of a hidden-sized vector (576 fp32) with each backend (gloo's
``dist.all_reduce``; the shared-memory one of specbed_kernels/allreduce.py), and a 512 MB read
on one core alone and on both cores at once (what the memory system gives two streams). Then,
per model and per k (tokens per forward, after a ``--context``-token prefill), in every repeat
and interleaved so that machine noise hits all of them alike: TP=1 (rank 0 alone on its core,
rank 1 parked in a gloo barrier); "tp1_both", the whole model on each core at once (two
independent forwards, no tensor parallelism: what two concurrent weight streams cost each
other); rank 0's shard alone while rank 1 is parked (no all-reduce: the compute share without a
concurrent neighbour); TP=2 with each backend (both ranks, one sharded model whose all-reduce is
switched between backends), and TP=2 with no all-reduce at all ("none": wrong logits, but it
separates each rank's compute from the waiting at the 2 x layers synchronisation points). Each
figure is the median over ``--iters`` forwards; the ratio TP2/TP1 is taken per repeat (paired)
and its median and range are printed. The machine is shared: the load average at the start and
end is printed with the numbers.

"target" is the bundled SmolLM2-135M-Instruct (9 heads / 3 KV heads: 6+3 query heads at TP=2),
"draft" the trained models/smollm2-draft (3 heads: 2+1).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from roofline_probes import read_bandwidth

from real.model.tp import apply_tp
from specbed_kernels.allreduce import GlooAllReduce, ShmAllReduce

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BACKENDS = ("gloo", "shm", "none")  # none: no sums (wrong logits), the compute share alone


class NoAllReduce:
    """Sums nothing: TP=2 without its all-reduces, to separate compute from synchronisation."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p)(
            lambda *_: 0)

    def __call__(self, x):
        return x

    def native(self):
        return ctypes.cast(self._fn, ctypes.c_void_p).value, 0

    def error(self, rc: int) -> Exception:
        return RuntimeError(rc)


class Switchable:
    """An all-reduce that delegates to one of several backends (one sharded model, many runs)."""

    def __init__(self, backends: dict) -> None:
        self.backends, self.current = backends, next(iter(backends.values()))
        self.rank, self.world = self.current.rank, self.current.world

    def __call__(self, x):
        return self.current(x)

    def native(self):
        return self.current.native()

    def error(self, rc: int) -> Exception:
        return self.current.error(rc)


def _load(name: str, dtype: torch.dtype):
    from real.model.weights import load_model

    return load_model(None if name == "target" else ROOT / "models" / "smollm2-draft", dtype=dtype,
                      max_seq=512)[0]


def _time_forwards(model, tokens: torch.Tensor, pos: int, iters: int) -> list[float]:
    """Seconds of ``iters`` forwards of ``tokens`` at slots pos.. (overwritten every time)."""
    times = []
    with torch.inference_mode():
        model(tokens, pos)  # warm-up (packs the native layer pointers)
        for _ in range(iters):
            start = time.perf_counter()
            model(tokens, pos)
            times.append(time.perf_counter() - start)
    return times


def _allreduce_latency(backend, n: int = 576, iters: int = 2000) -> dict:
    x = torch.ones(n)
    for _ in range(100):
        backend(x.fill_(1.0))
    times = []
    for _ in range(iters):
        x.fill_(1.0)
        start = time.perf_counter()
        backend(x)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"p50_us": 1e6 * times[len(times) // 2], "p99_us": 1e6 * times[int(len(times) * 0.99)],
            "mean_us": 1e6 * statistics.fmean(times)}


def _reads(rank: int, repeats: int = 5) -> dict:
    """GB/s of roofline_probes' one-core read (512 MB) on rank 0's core alone (rank 1 parked) and
    on both cores at once, interleaved: what the memory system gives two concurrent streams."""
    out: dict[str, list[float]] = {"alone": [], "both": []}
    for _ in range(repeats):
        if rank == 0:
            out["alone"].append(read_bandwidth(1, repeats=1) / 1e9)
        dist.barrier()
        out["both"].append(read_bandwidth(1, repeats=1) / 1e9)
        dist.barrier()
    return out


def _worker(rank: int, cfg: dict, store_path: str, out_path: str) -> None:
    os.sched_setaffinity(0, {cfg["cpus"][rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        backends = {"gloo": GlooAllReduce(), "shm": ShmAllReduce(), "none": NoAllReduce(rank, 2)}
        result = {"allreduce_576_fp32": {k: _allreduce_latency(backends[k]) for k in ("gloo", "shm")},
                  "read_gbs": _reads(rank), "forward": {}}
        dtype = DTYPES[cfg["dtype"]]
        for name in cfg["models"]:
            full = _load(name, dtype)  # both ranks: "tp1_both" runs one on each core at once
            switch = Switchable(backends)
            sharded = apply_tp(_load(name, dtype), rank=rank, world=2, allreduce=switch)
            prompt = torch.randint(0, sharded.args.vocab_size, (1, cfg["context"]),
                                   generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                sharded(prompt, 0)
                full(prompt, 0)
            rows = result["forward"][name] = {}
            for _ in range(cfg["repeats"]):
                for k in cfg["k"]:
                    tokens = prompt[:, :k]
                    row = rows.setdefault(str(k), {"tp1": [], "shard0_alone": [], "tp1_both": [],
                                                   **{f"tp2_{b}": [] for b in BACKENDS}})
                    if rank == 0:
                        row["tp1"].append(_time_forwards(full, tokens, cfg["context"], cfg["iters"]))
                        switch.current = backends["none"]
                        row["shard0_alone"].append(_time_forwards(sharded, tokens, cfg["context"], cfg["iters"]))
                    dist.barrier()
                    row["tp1_both"].append(_time_forwards(full, tokens, cfg["context"], cfg["iters"]))
                    dist.barrier()
                    for b in BACKENDS:
                        switch.current = backends[b]
                        row[f"tp2_{b}"].append(_time_forwards(sharded, tokens, cfg["context"], cfg["iters"]))
            del full, sharded
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _load_avg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["target", "draft"], choices=["target", "draft"])
    ap.add_argument("--k", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--cpus", nargs=2, type=int, default=[0, 1])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--out", type=Path, help="write the raw numbers here (JSON)")
    args = ap.parse_args()
    cfg = {k: getattr(args, k) for k in ("models", "k", "repeats", "iters", "context", "cpus", "dtype")}
    start_load = _load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(cfg, str(Path(tmp) / "store"), str(out)), nprocs=2, join=True)
        result = json.loads(out.read_text())
    result["load_avg"] = {"start": start_load, "end": _load_avg()}
    result["config"] = cfg
    print(f"load average (1/5/15 min): start {start_load}, end {result['load_avg']['end']}")
    print("all-reduce of 576 fp32, 2 pinned processes:")
    for b, r in result["allreduce_576_fp32"].items():
        print(f"  {b:5s} p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us   mean {r['mean_us']:8.1f} us")
    reads = result["read_gbs"]
    print(f"one core reading 512 MB: alone {statistics.median(reads['alone']):.1f} GB/s, with the other core "
          f"reading at once {statistics.median(reads['both']):.1f} GB/s (median of {len(reads['both'])}, rank 0)")
    print(f"forward latency ({args.dtype}, context {args.context}; {args.repeats} interleaved repeats "
          f"of {args.iters} forwards). ms: median of the repeats' medians; ratio /TP1: per repeat "
          "(paired), median [min, max]; best: fastest forward / fastest TP1 forward (noise only adds):")
    print(f"  {'model':6s} {'k':>2s}  {'variant':12s} {'ms':>8s}  {'ratio /TP1':>20s}  {'best':>5s}")
    for name, rows in result["forward"].items():
        for k, row in rows.items():
            tp1 = [statistics.median(r) for r in row["tp1"]]
            best1 = min(min(r) for r in row["tp1"])
            for variant in ("tp1", "tp1_both", "shard0_alone", *(f"tp2_{b}" for b in BACKENDS)):
                med = [statistics.median(r) for r in row[variant]]
                ratios = [m / t for m, t in zip(med, tp1, strict=True)]
                best = min(min(r) for r in row[variant]) / best1
                print(f"  {name:6s} {k:>2s}  {variant:12s} {1e3 * statistics.median(med):8.2f}  "
                      f"{statistics.median(ratios):5.2f} [{min(ratios):5.2f}, {max(ratios):5.2f}]  {best:5.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
