"""Packed weights on 2 MB transparent huge pages against 4 KB pages, paired in one process.

    .venv/bin/python benchmarks/bench_hugepages.py [--dtypes fp32 bf16] [--ks 1 2 4 8 16]
        [--repeats 15] [--context 200] [--cpus 1]

A k-token forward streams every packed weight panel once (specbed_kernels/native.py). With 4 KB pages
that stream needs a new TLB entry every 4 KB and the hardware prefetchers stop at each page
boundary; ``specbed_kernels.native`` therefore carves panels out of arenas advised with MADV_HUGEPAGE.
This benchmark loads the bundled target twice, packs one copy with ``native.HUGE_PAGES`` off and
one with it on, and alternates their forwards (the order flips every repeat), so both copies see
the same moment of a shared, drifting machine: per k, the median time of each and the median of
the per-repeat ratios 4 KB / huge (> 1: huge pages are faster). The kernel's own figure of the
huge pages the process holds (``AnonHugePages``) is printed as a check that they were granted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from real.model.decoder import Transformer
from real.model.weights import load_model
from specbed_kernels import native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def anon_huge_kb() -> int:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def packed_copy(dtype: torch.dtype, *, huge: bool, context: int) -> Transformer:
    """The bundled target with its panels packed (by a first forward) on the chosen pages."""
    native.HUGE_PAGES = huge
    native._arena.clear()  # a fresh arena: the two copies share none
    model, _ = load_model(None, dtype=dtype, max_seq=context + 32)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0)), 0)
    return model


def paired(models: dict[str, Transformer], *, k: int, context: int, repeats: int) -> dict[str, float]:
    tokens = torch.randint(0, 1000, (1, k), generator=torch.Generator().manual_seed(k))
    times: dict[str, list[float]] = {name: [] for name in models}
    order = list(models)
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms both
            for name in order if r % 2 else order[::-1]:
                model = models[name]
                model.truncate(context)
                start = time.perf_counter()
                model(tokens, context)
                times[name].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["4k"][1:], times["huge"][1:])]
    return {"ms_4k": 1e3 * statistics.median(times["4k"][1:]), "ms_huge": 1e3 * statistics.median(times["huge"][1:]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--cpus", type=int, nargs="+", default=None, help="pin to these CPUs")
    args = ap.parse_args()
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    torch.set_num_threads(1)
    if not native.AVAILABLE:
        raise SystemExit("error: the native kernels are not available here (SPECBED_NATIVE=0 or no compiler)")
    print(f"load average {os.getloadavg()[0]:.2f}; CPUs {sorted(os.sched_getaffinity(0))}")
    print("| dtype | k | 4 KB pages ms | huge pages ms | 4 KB / huge (median, min-max) |")
    print("|---|---|---|---|---|")
    for name in args.dtypes:
        before = anon_huge_kb()
        models = {"4k": packed_copy(DTYPES[name], huge=False, context=args.context)}
        models["huge"] = packed_copy(DTYPES[name], huge=True, context=args.context)
        granted = anon_huge_kb() - before
        for k in args.ks:
            r = paired(models, k=k, context=args.context, repeats=args.repeats)
            print(f"| {name} | {k} | {r['ms_4k']:.1f} | {r['ms_huge']:.1f} | {r['ratio']:.3f} "
                  f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |", flush=True)
        print(f"({name}: {granted / 1024:.0f} MB of huge pages granted to the packed copy)")
        del models
    native.HUGE_PAGES = True
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
