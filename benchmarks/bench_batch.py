"""A batched forward (continuous batching: B requests x k tokens each, every request over its own
KV-cache row and context) against the host's roofline, measured in the same run.

    .venv/bin/python benchmarks/bench_batch.py [--dtypes bf16 fp32] [--batches 1 2 4 8 16 32]
        [--ks 1 4] [--context 200] [--repeats 9] [--json FILE]

The roofline is bench_verify's, for B x k rows: max(bytes / read bandwidth, FLOPs / peak), with
bytes = every GEMM weight once + each request's KV cache, FLOPs = 2 per GEMM weight per row +
each request's attention over its own context; read bandwidth and FMA peak are probed right
before every forward (the host drifts by 20-30 % within seconds). Beside it: the same B requests
served one forward each (``x one by one``: what batching saves). Run pinned (taskset) on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_verify import host_flags, load_avg
from roofline_probes import DTYPES, PROBE_BUFFERS, gemm_peak, model_cost

from real.model.batch import CacheRows, Feed, forward_batch
from real.model.weights import load_model
from specbed_kernels import native


def batch_cost(model, batch: int, k: int, context: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(bytes, FLOPs) of B requests x k tokens: the weights once, each request's cache and attention."""
    one_bytes, one_flops = model_cost(model, k, context)
    a, size = model.args, model.dtype.itemsize
    kv = a.n_layers * 2 * a.n_kv_heads * a.head_dim * (context + k) * size
    return one_bytes + (batch - 1) * kv, batch * one_flops


def measure(model, rows: CacheRows, batch: int, k: int, *, context: int, repeats: int,
            torch_peak: float) -> dict:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(batch * 100 + k)
    feeds = [Feed(r, torch.randint(0, 1000, (k,), generator=gen).tolist(), context) for r in range(1, batch + 1)]
    x = PROBE_BUFFERS.setdefault("small", torch.ones(32 << 20))
    nbytes, flops = batch_cost(model, batch, k, context)
    times, alone, roofs = [], [], []
    forward_batch(model, feeds)  # warm
    for _ in range(repeats):
        start = time.perf_counter()
        native._LIB.sb_read_sum(x.data_ptr(), x.numel(), 1)
        bw = x.numel() * 4 / (time.perf_counter() - start)
        peak = max(torch_peak, native._LIB.sb_fma_peak(0.02) * 1e9)
        start = time.perf_counter()
        forward_batch(model, feeds)
        times.append(time.perf_counter() - start)
        roofs.append(max(nbytes / bw, flops / peak))
        start = time.perf_counter()
        for f in feeds:
            forward_batch(model, [f])
        alone.append(time.perf_counter() - start)
    shares = [r / t for r, t in zip(roofs, times)]
    return {"batch": batch, "k": k, "rows": batch * k, "ms": statistics.median(times) * 1e3,
            "one_by_one_ms": statistics.median(alone) * 1e3, "roofline_ms": statistics.median(roofs) * 1e3,
            "pct_roofline": 100 * statistics.median(shares)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not native.AVAILABLE:
        raise SystemExit("the native kernels did not build here: nothing to measure")
    print(f"host flags: {host_flags()}; threads {torch.get_num_threads()}; {load_avg()}")
    out = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        torch_peak = max(v for key, v in gemm_peak(dtype).items() if key.startswith("torch"))
        with torch.inference_mode():  # as real runs load (real/runtime/engine.py): inference tensors
            model, _ = load_model(None, dtype=dtype, max_seq=args.context + max(args.ks) + 8)
        rows = CacheRows(model, max(args.batches), args.context + max(args.ks) + 8)
        prompt = torch.randint(0, 1000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
        for r in range(1, max(args.batches) + 1):
            rows.prefill(r, prompt)
        print(f"\n{name}, context {args.context} per request")
        print("| batch | k | rows | ms | ms / row | roofline ms | % roofline | one by one ms | x one by one |")
        print("|---|---|---|---|---|---|---|---|---|")
        for k in args.ks:
            for b in args.batches:
                r = {"dtype": name, **measure(model, rows, b, k, context=args.context, repeats=args.repeats,
                                              torch_peak=torch_peak)}
                out.append(r)
                print(f"| {b} | {k} | {r['rows']} | {r['ms']:.1f} | {r['ms'] / r['rows']:.2f} | "
                      f"{r['roofline_ms']:.1f} | {r['pct_roofline']:.0f} | {r['one_by_one_ms']:.1f} | "
                      f"{r['one_by_one_ms'] / r['ms']:.2f} |", flush=True)
    print(load_avg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
