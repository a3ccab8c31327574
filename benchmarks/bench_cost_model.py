"""Micro-benchmark: wall time per RooflineCost.forward() call, as the SimPy engine calls it.

    .venv/bin/python benchmarks/bench_cost_model.py [calls]

Prints µs per call for the memoized hot path (mixed roles, token counts, growing context and
pipeline stages), the one-off cost of a new (role, tokens, layers) key, and the unmemoized
roofline for comparison.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time

from sim.cost.roofline import RooflineCost
from sim.cost.roofline_forward import forward_cost
from sim.presets import load_hardware_preset, load_model_preset
from testbed.config import ExperimentConfig, PairConfig, PlacementConfig


def main(calls: int = 200_000) -> None:
    t = dataclasses.replace(load_model_preset("llama3_70b"), quant="int4_awq")
    d = dataclasses.replace(load_model_preset("llama3_2_3b"), quant="int4_awq")
    exp = ExperimentConfig(pair=PairConfig(target=t, draft=d), hardware=load_hardware_preset("h800x8"),
                           placement=PlacementConfig(target_gpus=6, draft_gpus=2))
    cm = RooflineCost(exp)
    rng = random.Random(0)
    stages = [None, (0, 20), (20, 40), (40, 60), (60, 80)]
    pattern = [(rng.choice(("target", "draft")), rng.randint(1, 9), rng.randint(0, 8000),
                rng.choice(stages)) for _ in range(calls)]
    pattern = [(r, k, c, s if r == "target" else None) for r, k, c, s in pattern]
    for r, k, c, s in pattern[:1000]:  # warm the memo (keys are few: roles x tokens x stages)
        cm.forward(r, k, c, s)
    f = cm.forward
    t0 = time.perf_counter()
    for r, k, c, s in pattern:
        f(r, k, c, s)
    hot = (time.perf_counter() - t0) / calls * 1e6

    t0 = time.perf_counter()
    cold_n = 200
    for k in range(100, 100 + cold_n):  # new token counts: a fresh memo key each
        f("target", k, 500)
    cold = (time.perf_counter() - t0) / cold_n * 1e6

    t0 = time.perf_counter()
    n = 2000
    for r, k, c, s in pattern[:n]:
        m, tp = (t, 6) if r == "target" else (d, 2)
        forward_cost(m, exp.hardware, tp=tp, tokens=k, context=c, layers=s)
    plain = (time.perf_counter() - t0) / n * 1e6
    print(f"RooflineCost.forward, memoized: {hot:8.3f} us/call  ({calls} calls, {len(cm._memo)} keys)")
    print(f"first call of a new key:        {cold:8.1f} us")
    print(f"forward_cost, unmemoized:       {plain:8.1f} us/call")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
