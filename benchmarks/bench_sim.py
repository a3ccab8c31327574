"""Simulator speed: simulated tokens per wall-second for `sync` with i.i.d. acceptance.

    python benchmarks/bench_sim.py [--tokens N] [--cost-model roofline|analytic] [--batch B] [--profile]

Runs only the schedule (no `ar` baseline, no files), on one core, and prints tokens per
wall-second; with --profile, the top functions by cumulative time (where the time goes).
``--batch B``: under load, a closed loop of B clients served in batched rounds
(sim/runtime/batching.py), i.e. every round a batch of B.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.runtime.engine import make_requests, simulate  # noqa: E402
from tests.conftest import compose_exp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--cost-model", default="roofline")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--spans", action="store_true", help="also record timeline spans")
    ap.add_argument("--batch", type=int, default=1, help="closed-loop clients (batched rounds when > 1)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    n_prompts = max(8, 4 * args.batch)
    exp = compose_exp("schedule=sync", "acceptance=iid", f"sim.cost_model={args.cost_model}",
                      f"schedule.gamma={args.gamma}", f"workload.num_prompts={n_prompts}",
                      f"workload.max_new_tokens={args.tokens // n_prompts}",
                      f"workload.concurrency={args.batch}")
    requests = make_requests(exp)
    simulate(exp, requests[:1], seed=1)  # warm caches/imports
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    rec = simulate(exp, requests, seed=0, keep_spans=args.spans)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    tokens = sum(r["generated"] for r in rec.requests)
    print(f"sync, iid, {args.cost_model}, γ={args.gamma}, batch {args.batch}: {tokens} tokens in {wall:.3f} s "
          f"= {tokens / wall:,.0f} simulated tokens per wall-second "
          f"({len(rec.rounds)} rounds, {len(rec.rounds) / wall:,.0f} rounds/s)")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
