"""Simulator against real for `async` on this machine (issue 12): tokens/s and tokens per
verification (compression ratio + 1), predicted (backend=sim, the calibrated profile with the
contention tables, acceptance replayed from a real run on other prompts) against measured
(backend=real), per split of `+sweep=gpu_split backend=real` — async 1+1, the serial tree and the
sync chain on both cores, ar — and whether the simulator ranks the splits in the measured order.
Goal: median |error| ≤ 5 % for both metrics, same ranking.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async_sim_real.py [--prompts 8] [--tokens 128]
        [--dir DIR] [--summarize-only] [-- extra overrides]

It runs ``python -m testbed +sweep=gpu_split backend=real workload.num_prompts=N
workload.max_new_tokens=M hydra.sweep.dir=DIR`` (the latency profile is measured first when
missing: ~15 min on 2 cores), then reads the sweep's runs with the report's own pairing
(testbed.report.sections_split) and prints one line per split and the summary as JSON.
``--summarize-only`` reads an existing DIR (e.g. of `+sweep=validate hydra.sweeper.only=[async]`).
The machine may be shared: run it alone; real timings here are noisy by ±20–30 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize(sweep_dir: Path) -> dict:
    from testbed.report.sections_split import GROUP, same_ranking, split_pairs
    from testbed.report.sections_validate import validation_frame
    from testbed.results import find_runs

    val = validation_frame(find_runs([sweep_dir]))
    pairs = split_pairs(val)
    out: dict = {"sweep_dir": str(sweep_dir), "groups": []}
    if pairs.empty:
        out["error"] = "no split was both measured and predicted"
        return out
    for key, g in pairs.groupby(GROUP, sort=True):
        a = g[g["split"].str.match(r"t\d+")]
        out["groups"].append({
            "key": dict(zip(GROUP, map(str, key))),
            "splits": g[["split", "predicted_tokens_per_s", "measured_tokens_per_s", "tokens_per_s_error_pct",
                         "tokens_per_verification_error_pct"]].round(3).to_dict("records"),
            "median_abs_tokens_per_s_error_pct": float(g["tokens_per_s_error_pct"].abs().median()),
            "median_abs_tokens_per_verification_error_pct":
                float(g["tokens_per_verification_error_pct"].abs().median()),
            "async_tokens_per_s_error_pct": [float(v) for v in a["tokens_per_s_error_pct"]],
            "async_tokens_per_verification_error_pct": [float(v) for v in a["tokens_per_verification_error_pct"]],
            "same_ranking": bool(same_ranking(g)),
            "best_predicted": str(g.loc[g["best_predicted"], "split"].iloc[0]),
            "best_measured": str(g.loc[g["best_measured"], "split"].iloc[0]),
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    sweep_dir = args.dir or ROOT / "reports" / "bench" / time.strftime("async_sim_real_%Y%m%d_%H%M%S")
    if not args.summarize_only:
        cmd = [sys.executable, "-m", "testbed", "+sweep=gpu_split", "backend=real",
               f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.tokens}",
               f"hydra.sweep.dir={sweep_dir}", *args.extra]
        print("$ " + " ".join(cmd[1:]), flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    res = summarize(sweep_dir)
    for g in res["groups"]:
        for s in g["splits"]:
            print(f"{s['split']:>10}: predicted {s['predicted_tokens_per_s']:7.2f} tok/s, measured "
                  f"{s['measured_tokens_per_s']:7.2f} ({s['tokens_per_s_error_pct']:+6.1f} %), tokens per "
                  f"verification error {s['tokens_per_verification_error_pct']:+6.1f} %")
        print(f"median |error|: tokens/s {g['median_abs_tokens_per_s_error_pct']:.1f} %, tokens/verification "
              f"{g['median_abs_tokens_per_verification_error_pct']:.1f} % (goal ≤ 5 %); same ranking: "
              f"{g['same_ranking']} (best predicted {g['best_predicted']}, measured {g['best_measured']})")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
