"""Real `async` (draft and target on one core each) against the real `sync` chain (best γ), the
real serial tree (TP over all cores) and `ar`, on the bundled pair, paired per prompt.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py [--prompts 3] [--tokens 64]
        [--gammas 2 3 4] [--out FILE.json] [-- extra overrides]

Every run goes through ``real.runtime.engine.run`` exactly as ``python -m testbed backend=real`` does.
Per prompt and schedule: decode tokens/s; per schedule: tokens per verification
(mean_accepted_len), and for async the share of decode time spent on transport and bookkeeping
(messages, subtree selection and packing, re-root + KV compaction; measured on the leaders).
``ar`` is each run's own baseline: on the target's single core for async, on all cores for the
TP runs. The machine may be shared: the load average before and after is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compose_exp(overrides: list[str]):  # -> testbed.config.ExperimentConfig
    from testbed.compose import compose_experiment

    return compose_experiment(overrides)


def per_prompt(rec) -> list[float]:  # type: ignore[no-untyped-def]
    return [r["generated"] / r["decode_s"] for r in rec.requests]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from real.runtime.engine import run

    common = ["backend=real", "workload.split=test", f"workload.num_prompts={a.prompts}",
              f"workload.max_new_tokens={a.tokens}", "sampling.temperature=0", "real.ignore_eos=true",
              "real.progress=false", *a.overrides]
    all_cores = ["placement.target_gpus=2", "placement.draft_gpus=2"]
    runs = {"async 1+1": ["schedule=async"],
            "serial tree TP2": ["schedule=sync", "schedule.tree=true", *all_cores],
            **{f"sync γ={g} TP2": ["schedule=sync", f"schedule.gamma={g}", *all_cores] for g in a.gammas}}
    print(f"load average before: {os.getloadavg()}", flush=True)
    out: dict = {}
    for name, extra in runs.items():
        t = time.time()
        res = run(compose_exp([*common, *extra]))
        rounds, _, timeline = res.recorder.frames()
        row = {"tokens_per_s": per_prompt(res.recorder), "ar_tokens_per_s": per_prompt(res.baseline),
               "tokens_per_verification": float((rounds.accepted + 1).mean()),
               "outputs_equal_ar": [r["output_ids"] for r in res.recorder.requests]
               == [r["output_ids"] for r in res.baseline.requests],
               "wall_s": time.time() - t}
        if name.startswith("async"):
            decode = sum(r["decode_s"] for r in res.recorder.requests)
            links = timeline[timeline.kind == "link"]
            book = sum(v for k, v in res.extra.items() if k.startswith("async_") and k.endswith("_s"))
            row |= {"tree": {k: res.extra.get(k) for k in ("tree_width", "tree_budget", "tree_depth_used",
                                                            "t_target_ms", "t_draft_ms")},
                    "bookkeeping_share": book / decode,
                    "link_time_share": float((links.end_s - links.start_s).sum()) / decode,
                    "bookkeeping_s": {k: v for k, v in res.extra.items() if k.startswith("async_")}}
        out[name] = row
        print(name, json.dumps(row, default=str), flush=True)
    print(f"load average after: {os.getloadavg()}")
    base = out["async 1+1"]["ar_tokens_per_s"]
    print(f"\n{'schedule':18} {'tok/s (per prompt)':34} {'x ar(1 core), median':>22} {'tok/verif':>10}")
    for name, row in out.items():
        ratios = [s / b for s, b in zip(row["tokens_per_s"], base)]
        print(f"{name:18} {' '.join(f'{v:7.2f}' for v in row['tokens_per_s']):34} "
              f"{statistics.median(ratios):22.3f} {row['tokens_per_verification']:10.3f}")
    print(f"{'ar 1 core':18} {' '.join(f'{v:7.2f}' for v in base):34}")
    print(f"{'ar TP2':18} {' '.join(f'{v:7.2f}' for v in out['serial tree TP2']['ar_tokens_per_s']):34}")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
