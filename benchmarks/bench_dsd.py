"""Real DSD (schedule=decentralized) against `ar` over the same pipeline, and against DSD's eq. 9.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dsd.py [--nodes 4] [--latency-ms 20]
        [--prompts 3] [--tokens 64] [--taus 0 0.2] [--gammas 8 4] [--out FILE.json]
        [-- extra overrides]

One real run per (temperature, τ) on the bundled pair, N stage processes (one per emulated node)
joined by emulated WAN links of ``--latency-ms`` one way (no jitter, 1 Gb/s), exactly as
``python -m testbed backend=real schedule=decentralized placement.nodes=N`` runs it. Reported:

- the speedup over `ar` on the same pipeline (each run's own baseline, paired per prompt: the
  median of per-prompt ratios), at temperature 0 and 1 with τ = 0 (lossless);
- DSD's eq. 9 evaluated with the run's *measured* α (Leviathan's eq. 1 inverted from tokens per
  round), c, t0 (a 1-token traversal of all stages) and t1 (mean one-way link time);
- the window's traversal (γ + 1 tokens through every stage) in units of t0: eq. 9 counts it as
  one t0, which holds while a (γ + 1)-token forward costs what one token does (on a CPU: while
  it is memory bound, docs/kernels.md), so each γ of ``--gammas`` (default: DSD's 8 and 4) is run;
- the extra speedup of each τ > 0 over τ = 0 at temperature 1, with its quality cost: target
  NLL per generated token (against τ = 0 and `ar`), the share of outputs identical to the τ = 0
  run (same seed: coupled random streams) and the mean first-divergence position.

The machine may be shared: the load average before and after is printed; timings on a loaded
2-core machine are noisy (±20-30 %), so read the paired ratios.
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--gammas", type=int, nargs="+", default=[8, 4],
                    help="draft windows to run (DSD's §3.1 uses 8)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from real.runtime.engine import run
    from testbed.metrics import divergence

    common = ["backend=real", "schedule=decentralized", f"placement.nodes={a.nodes}", "network=wan",
              f"network.latency_ms={a.latency_ms}", "network.jitter_ms=0", "workload.split=test",
              f"workload.num_prompts={a.prompts}", f"workload.max_new_tokens={a.tokens}",
              "real.ignore_eos=true", "real.progress=false", "real.threads=1", "real.recv_timeout_s=120",
              *a.overrides]
    cases = [(gamma, temp, tau) for gamma in a.gammas
             for temp, tau in [(0.0, 0.0), *[(1.0, tau) for tau in sorted(set([0.0, *a.taus]))]]]
    print(f"load average before: {os.getloadavg()}", flush=True)
    out: dict = {}
    outputs: dict = {}
    for gamma, temp, tau in cases:
        name = f"γ={gamma} T={temp:g} τ={tau:g}"
        extra = [f"schedule.gamma={gamma}", f"sampling.temperature={temp}"]
        if tau > 0:
            extra += ["schedule.adaptive=true", f"schedule.tau={tau}"]
        t = time.time()
        res = run(compose_exp([*common, *extra]))
        x = res.extra
        spec, base = per_prompt(res.recorder), per_prompt(res.baseline)
        outputs[name] = [r["output_ids"] for r in res.recorder.requests]
        row = {"tokens_per_s": spec, "ar_tokens_per_s": base,
               "speedup_median": statistics.median(s / b for s, b in zip(spec, base)),
               "eq9_speedup": x.get("theory_speedup"), "alpha": x.get("alpha_measured"),
               "c": x.get("c_measured"), "t0_ms": x.get("t0_ms"), "t1_ms": x.get("t1_ms"),
               "t_window_ms": x.get("t_window_ms"), "window_over_t0": _ratio(x.get("t_window_ms"), x.get("t0_ms")),
               "tokens_per_round": x.get("tokens_per_round"), "comm_reduction_eq5": x.get("comm_reduction_eq5"),
               "nll_per_token": x.get("target_nll_per_token"), "ar_nll_per_token": x.get("baseline_nll_per_token"),
               "key_token_fraction": x.get("key_token_fraction"), "wall_s": time.time() - t}
        if temp == 0.0:
            row["identical_to_ar"] = x.get("identical_share")
        out[name] = row
        print(name, json.dumps(row, default=str), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"\nN={a.nodes}, t1={a.latency_ms:g} ms one way")
    print(f"{'case':18} {'speedup (median/prompt)':>24} {'eq. 9 (measured)':>17} {'vs eq. 9':>9} {'α':>6} "
          f"{'t0 ms':>7} {'t1 ms':>7} {'window/t0':>10} {'NLL/tok':>8}")
    for name, row in out.items():
        eq9 = row["eq9_speedup"] or float("nan")
        print(f"{name:18} {row['speedup_median']:24.3f} {eq9:17.3f} {row['speedup_median'] / eq9 - 1:+9.1%} "
              f"{row['alpha'] or 0:6.3f} {row['t0_ms'] or 0:7.1f} {row['t1_ms'] or 0:7.1f} "
              f"{row['window_over_t0'] or float('nan'):10.2f} {row['nll_per_token'] or float('nan'):8.3f}")
    for name, row in out.items():
        gamma = name.split()[0]
        lossless = out.get(f"{gamma} T=1 τ=0")
        if " T=1 " not in name or row is lossless or lossless is None:
            continue
        gain = statistics.median(s / b for s, b in zip(row["tokens_per_s"], lossless["tokens_per_s"]))
        dv = divergence(outputs[name], outputs[f"{gamma} T=1 τ=0"])
        row |= {"extra_speedup_over_tau0": gain, **{f"vs_tau0_{k}": v for k, v in dv.items()}}
        print(f"{name}: x{gain:.3f} over τ=0 (median per prompt); NLL/token {row['nll_per_token']:.3f} "
              f"vs {lossless['nll_per_token']:.3f} at τ=0; identical to τ=0: {dv['identical_share']:.2f}, "
              f"first divergence at {dv['first_divergence_mean']:.1f} on average")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
