"""The TP 2 part of bench_verify.py: the bundled target's k-token forward on two pinned cores
(benchmarks/bench_tp.py's workers: one process per core, the shared-memory all-reduce) against
TP 1 on one core and against the two-core roofline measured in the same run (both cores reading
at once -- on a VM two cores may read far less than twice one -- and both cores' FMA peak).

    .venv/bin/python benchmarks/bench_verify.py --tp2 [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from roofline_probes import DTYPES, gemm_peak, model_cost, read_bandwidth

from real.model.weights import load_model

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 8)


def run_tp2(args: argparse.Namespace) -> list[dict]:
    cpus = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))[:2]
    if len(cpus) < 2:
        print("TP 2: needs two CPUs; skipped")
        return []
    os.sched_setaffinity(0, cpus)
    rows = []
    for name in args.dtypes:
        bandwidth = read_bandwidth(2)
        peak = 2 * max(gemm_peak(DTYPES[name]).values())
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "tp.json"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_tp.py"), "--models", "target",
                   "--k", *map(str, KS), "--context", str(args.context), "--dtype", name,
                   "--cpus", *map(str, cpus), "--out", str(out)]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
            result = json.loads(out.read_text())
        model, _ = load_model(None, dtype=DTYPES[name], max_seq=args.context + 32)
        print(f"\nTP 2 ({name}): two cores read {bandwidth / 1e9:.1f} GB/s together, FMA peak "
              f"{peak / 1e9:.0f} GFLOP/s together")
        print("| k | TP 1 ms | TP 2 ms | TP 2 / TP 1 | two-core roofline ms | % roofline |")
        print("|---|---|---|---|---|---|")
        for k in KS:
            row = result["forward"]["target"][str(k)]
            tp1 = statistics.median(statistics.median(r) for r in row["tp1"]) * 1e3
            tp2 = statistics.median(statistics.median(r) for r in row["tp2_shm"]) * 1e3
            nbytes, flops = model_cost(model, k, args.context)
            roof = max(nbytes / bandwidth, flops / peak) * 1e3
            rows.append({"dtype": name, "k": k, "tp1_ms": tp1, "tp2_ms": tp2, "roofline_ms": roof,
                         "pct_roofline": 100 * roof / tp2, "bandwidth_gbs": bandwidth / 1e9})
            print(f"| {k} | {tp1:.1f} | {tp2:.1f} | {tp2 / tp1:.2f} | {roof:.1f} | {100 * roof / tp2:.0f} |",
                  flush=True)
        del model
    return rows
