"""Run every benchmark in benchmarks/ in turn, with small settings (``make bench``).

    .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--cpus 0] [--threads 1]
                                           [--out-dir reports/bench]

Each ``bench_*.py`` runs as its own process (a crash or a leaked thread pool in one cannot
disturb the next) with the arguments below; a benchmark added later without an entry runs with
no arguments. Output streams through; a summary of exit codes and wall times comes last, and
the run fails if any benchmark failed. Benchmarks that write JSON put it in ``--out-dir``.
``--cpus``/``--threads`` apply to the real-model benchmarks (pinning: see bench_decode.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def small_args(name: str, out_dir: Path, cpus: str, threads: int) -> list[str]:
    """The quick settings of each benchmark (a few minutes in all on 2 CPU cores)."""
    pin = [*(["--cpus", cpus] if cpus else []), *(["--threads", str(threads)] if threads else [])]
    return {
        "bench_cost_model": ["20000"],
        "bench_sim": ["--tokens", "20000"],
        "bench_transport": ["--round-trips", "500", "--messages", "100",
                            "--out", str(out_dir / "bench_transport.json")],
        "bench_decode": ["--new-tokens", "64", "--runs", "3", *pin,
                         "--out", str(out_dir / "bench_decode.json")],
        "bench_eagle_features": ["--shards", "2", "--steps", "20"],
        "bench_hf": ["--prompts", "1", "--new-tokens", "32", "--runs", "1", *pin,
                     "--out", str(out_dir / "bench_hf.json")],
    }.get(name, [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names, e.g. bench_decode")
    ap.add_argument("--cpus", default="", help="pin the real-model benchmarks to these CPUs")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for the real-model benchmarks")
    ap.add_argument("--out-dir", default=str(ROOT / "reports" / "bench"))
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scripts = sorted(p for p in HERE.glob("bench_*.py") if args.only is None or p.stem in args.only)
    results: list[tuple[str, int, float]] = []
    for script in scripts:
        cmd = [sys.executable, str(script), *small_args(script.stem, out_dir, args.cpus, args.threads)]
        print(f"\n=== {script.stem}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        results.append((script.stem, rc, time.perf_counter() - start))
    print("\n=== summary")
    for name, rc, seconds in results:
        print(f"{name:20s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {seconds:6.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
