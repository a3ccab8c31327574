"""Whole k-token forwards of the bundled target with two builds of specbed_kernels/native.cpp, paired.

    taskset -c 1 .venv/bin/python benchmarks/bench_forward_pair.py --base OLD_NATIVE_CPP
        [--dtypes fp32 bf16] [--ks 1 8 16] [--context 200] [--pairs 15]

One model (its packed weights are the same for both builds); the two libraries take turns call
by call, the first of each pair alternating, because the host drifts by 20-30 % within minutes.
Prints per k the median ms of each build and the median of the pairs' ratios (this build / base),
and checks that both builds give the same logits bit for bit (a kernel change that keeps every
chain's order must). ``bench_gemm_rows.py`` pairs the GEMMs alone; this pairs everything a
forward runs (attention, norms, RoPE, the LM head).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real.model.weights import load_model  # noqa: E402
from specbed_kernels import native, native_build  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_base(source: Path):  # noqa: ANN201 - a ctypes.CDLL
    """``source`` built and given the signatures specbed_kernels.native gives its own library."""
    lib = native_build.load(source)
    if lib is None:
        raise SystemExit(f"{source}: build failed")
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other native.cpp")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=15)
    args = ap.parse_args()
    if native._LIB is None:
        raise SystemExit("the native kernels are off here (no compiler, or SPECBED_NATIVE=0)")
    torch.set_num_threads(1)
    libs = {"this": native._LIB, "base": load_base(Path(args.base))}
    print("| dtype | k | context | this ms | base ms | this / base (median of pairs) |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes:
        model, _ = load_model(None, dtype=DTYPES[name], max_seq=args.context + max(args.ks) + 8)
        with torch.inference_mode():
            model(torch.randint(0, 1000, (1, args.context)), 0)
            for k in args.ks:
                tokens = torch.randint(0, 1000, (1, k))
                times: dict[str, list[float]] = {"this": [], "base": []}
                for i in range(args.pairs):
                    logits = {}
                    for which in ("this", "base") if i % 2 == 0 else ("base", "this"):
                        native._LIB = libs[which]
                        model.truncate(args.context)
                        start = time.perf_counter()
                        logits[which] = model(tokens, args.context)
                        times[which].append(time.perf_counter() - start)
                    if not torch.equal(logits["this"], logits["base"]):
                        print(f"{name} k={k}: the builds' logits differ")
                native._LIB = libs["this"]
                ratio = statistics.median(a / b for a, b in zip(times["this"], times["base"]))
                print(f"| {name} | {k} | {args.context} | {statistics.median(times['this']) * 1e3:.1f} | "
                      f"{statistics.median(times['base']) * 1e3:.1f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
