"""testbed/report/sections_load.py: speculation under load in the report (`+sweep=load`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.runtime.engine import run
from testbed.report import build_report
from testbed.report.sections_load import crossover
from testbed.results import write_run
from tests.conftest import compose_exp


def frame(speedups: dict[float, list[float]]) -> pd.DataFrame:
    rows = [{"schedule": "sync", "load": load, "tpot_speedup": s, "load_speedup": 1.0}
            for load, ss in speedups.items() for s in ss]
    return pd.DataFrame(rows + [{"schedule": "ar", "load": load, "tpot_speedup": 1.0, "load_speedup": 1.0}
                                for load in speedups])


@pytest.mark.parametrize(("speedups", "expected"), [
    ({1: [1.3, 1.1], 2: [1.1, 0.9], 4: [0.9, 0.95], 8: [0.7, 0.8]}, 4.0),  # the best variant decides
    ({1: [1.2], 2: [0.9], 4: [1.05], 8: [0.8]}, 8.0),  # pays again at 4: the crossover is where it stays lost
    ({1: [1.2], 2: [1.1]}, None),  # pays at every load
    ({1: [0.9], 2: [0.8]}, None),  # at none
])
def test_the_crossover_is_the_load_from_which_speculation_never_pays(speedups, expected) -> None:
    assert crossover(frame(speedups)) == expected


def test_a_variant_that_loses_throughput_does_not_pay() -> None:
    d = frame({1: [1.3], 2: [1.2], 4: [1.1]})
    d.loc[(d["schedule"] == "sync") & (d["load"] == 4), "load_speedup"] = 0.9  # saturated: capacity lost
    assert crossover(d) == 4.0


def test_a_load_sweep_report_shows_variants_best_gamma_and_the_crossover(tmp_path: Path) -> None:
    base = ("workload.arrival=poisson", "workload.num_prompts=12", "workload.max_new_tokens=48")
    jobs = [("schedule=ar",), ("schedule=sync", "schedule.gamma=2"), ("schedule=sync", "schedule.gamma=4"),
            ("schedule=sync", "lookahead=heuristic")]
    for i, job in enumerate(jobs):
        for rate in (1, 64):
            exp = compose_exp(*base, *job, f"workload.rate={rate}")
            write_run(tmp_path / "sweep" / f"{i}_{rate}", exp, run(exp))
    for job in jobs[:2]:  # closed-loop clients: a load of another kind, its own table
        for clients in (2, 8):
            exp = compose_exp(*base[1:], *job, "workload.arrival=closed", f"workload.concurrency={clients}")
            write_run(tmp_path / "sweep" / f"closed_{job[-1]}_{clients}", exp, run(exp))
    md = build_report([tmp_path / "sweep"], tmp_path / "report").read_text()
    part = md.split("## Speculation under load", 1)[1]
    assert "**sim, load in requests/s**" in part and "**sim, load in clients**" in part
    assert (tmp_path / "report" / "load_sim_closed.png").exists()
    for text in ("sync γ=2", "sync γ=4", "sync heuristic (γ≤4)", "Best static γ per load", "TPOT p50 ms"):
        assert text in part, text
    assert "stops beating `ar`" in part or "No crossover" in part
    assert (tmp_path / "report" / "load_sim.png").stat().st_size > 10_000
