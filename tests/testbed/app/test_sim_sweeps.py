"""`+sweep=gpu_split` and `+sweep=wan`: every job composes as intended; their report sections."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sim.runtime.engine import run
from testbed.app.preflight import command_pairs
from testbed.compose import register_configs
from testbed.config_validate import validate
from testbed.report import build_report
from testbed.results import write_run
from tests.conftest import CONF, compose_exp, run_cli

PAIRS = ("llama3_70b+llama3_2_3b", "qwen2_72b+qwen2_1_5b", "deepseek_coder_33b+deepseek_coder_1_3b")


def sweep_jobs(sweep: str) -> list[list[str]]:
    """The override lists of every job, as Hydra's basic sweeper builds them."""
    register_configs(command_pairs([f"+sweep={sweep}"]))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+sweep={sweep}"], return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    axes = [[f"{k}={v}" for v in str(vals).split(",")] for k, vals in cfg.hydra.sweeper.params.items()]
    return [[f"+sweep={sweep}", *combo] for combo in itertools.product(*axes)]


def test_gpu_split_composes_every_split_for_every_pair() -> None:
    from tests.testbed.report.test_gpu_split_measured import _grid

    only, grid = _grid()  # the grid named sim_h800x8 (GridsSweeper)
    assert only == "sim_h800x8"
    jobs = [["+sweep=gpu_split", *job] for job in grid]
    assert len(jobs) == 27
    seen = set()
    for job in jobs:
        exp = compose_exp(*job)
        pl, s = exp.placement, exp.schedule
        assert exp.hardware.name == "h800x8" and not exp.report.per_run
        seen.add((exp.pair.name, s.name, s.tree, pl.target_gpus, pl.draft_gpus))
    want = {(p, "async", False, x, 8 - x) for p in PAIRS for x in range(1, 8)}
    want |= {(p, "sync", tree, 8, 8) for p in PAIRS for tree in (False, True)}
    assert seen == want


def grid_jobs(sweep: str, *overrides: str) -> list[list[str]]:
    """The jobs of the grids sweeper's grids that ``hydra.sweeper.only`` selects (the sweep's
    ``params`` first, then the grid's keys: hydra_plugins.specbed_sweeper)."""
    register_configs(command_pairs([f"+sweep={sweep}"]))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+sweep={sweep}", *overrides], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    jobs = []
    for name in sweeper.only:
        params = {**(sweeper.params or {}), **sweeper.grids[name]}
        axes = [[f"{k}={v}" for v in str(vals).split(",")] for k, vals in params.items()]
        jobs += [[f"+sweep={sweep}", *overrides, *combo] for combo in itertools.product(*axes)]
    return jobs


def test_wan_sweep_grid() -> None:
    jobs = grid_jobs("wan")
    assert len(jobs) == 60
    keys = {tuple(sorted(o for o in job if not o.startswith("+"))) for job in jobs}
    assert len(keys) == 60
    for job in (jobs[0], jobs[-1]):  # the corners compose and validate
        exp = compose_exp(*job)
        assert exp.schedule.name == "decentralized" and exp.schedule.adaptive
        assert exp.hardware.name == "a800_nodes" and exp.network.name == "wan"
        assert exp.acceptance.oracle == "synthetic" and exp.sampling.temperature == 1.0
    last = compose_exp(*jobs[-1])
    assert (last.placement.nodes, last.network.latency_ms, last.schedule.tau) == (8, 100.0, 0.3)


def test_wan_sweep_on_the_real_backend_measures_and_predicts_every_point() -> None:
    jobs = grid_jobs("wan", "backend=real")
    assert len(jobs) == 48  # 3 nodes x 4 latencies x 2 τ x 2 roles
    measure = compose_exp(*jobs[0])
    assert (measure.backend, measure.hardware.name, measure.pair.name) == ("real", "local", "smollm2_135m+smollm2_draft")
    assert measure.schedule.name == "decentralized" and measure.schedule.adaptive
    predict = compose_exp(*jobs[-1], "acceptance.trace_path=/tmp")
    assert predict.backend == "sim" and predict.sim.cost_model == "profile"  # backend=real does not win
    assert (predict.placement.nodes, predict.network.latency_ms, predict.schedule.tau) == (4, 50.0, 0.2)
    assert not predict.sim.profile_rescale and predict.acceptance.oracle == "trace"
    assert predict.sim.profile_drift == "run_probe"  # the measured run's probes, not its timings


def _write(tmp: Path, name: str, *overrides: str) -> None:
    exp = validate(compose_exp(*overrides))
    write_run(tmp / name, exp, run(exp))


def test_gpu_split_report_section(tmp_path: Path) -> None:
    small = ("workload.num_prompts=1", "workload.max_new_tokens=32", "hardware=h800x8")
    for split in ("t2", "t6", "sync", "sync_tree"):
        _write(tmp_path, split, f"+split={split}", *small)
    md = build_report([tmp_path], tmp_path).read_text()
    section = md.split("## GPU split")[1].split("\n## ")[0]
    assert "| t2 | t6 | sync | sync_tree |" in section
    assert "best split" in section and (tmp_path / "gpu_split.png").exists()
    assert "## Timeline (Gantt)" in md and (tmp_path / "gantt.png").exists()
    assert "\n## Timeline\n" not in md  # the plain timeline defers to the Gantt section


def test_decentralized_report_section(tmp_path: Path) -> None:
    common = ("schedule=decentralized", "hardware=a800_nodes", "sim.cost_model=analytic",
              "acceptance=iid", "network.jitter_ms=0", "network.bandwidth_gbit_s=0",
              "placement.nodes=4", "workload.num_prompts=1", "workload.max_new_tokens=64")
    for lat in (0, 20, 50):
        _write(tmp_path, f"lat{lat}", *common, f"network.latency_ms={lat}")
    md = build_report([tmp_path], tmp_path).read_text()
    section = md.split("## Decentralized speculative decoding (DSD)")[1].split("\n## ")[0]
    assert "eq. (5)" in section and "comm_reduction_eq5" in section
    assert "Theory check" in section and (tmp_path / "decentralized.png").exists()
    # the sweep report's figures drawn in two processes: the same report, the same figures
    two = build_report([tmp_path], tmp_path / "two", workers=2)
    assert two.read_text().split("\n", 3)[3] == md.split("\n", 3)[3]  # (line 3 names the paths)
    assert {f.name for f in two.parent.glob("*.png")} == {f.name for f in tmp_path.glob("*.png")}


@pytest.mark.slow
def test_gpu_split_sweep_end_to_end(tmp_path: Path) -> None:
    out = run_cli("+sweep=gpu_split", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "report.md").read_text()
    assert "27 run(s)" in md
    table = md.split("Decode tokens/s of every split:")[1]
    for pair in PAIRS:
        row = next(line for line in table.splitlines() if line.startswith(f"| {pair} "))
        assert row.count("|") == 12 and "—" not in row  # pair, hardware, t1..t7, sync, sync_tree


def test_decentralized_report_with_measured_and_predicted_runs_of_each_point(tmp_path: Path) -> None:
    # `+sweep=wan backend=real`: every (nodes, latency, τ) point has a real and a simulated run;
    # the effect of τ is taken per backend (it failed on the duplicated points before)
    common = ("schedule=decentralized", "schedule.adaptive=true", "hardware=a800_nodes",
              "sim.cost_model=analytic", "acceptance=synthetic", "sampling.temperature=1.0",
              "network.jitter_ms=0", "placement.nodes=2", "workload.num_prompts=1",
              "workload.max_new_tokens=32")
    for lat in (0, 20):
        for tau in (0.0, 0.3):
            for backend in ("real", "sim"):
                d = tmp_path / f"{backend}{lat}t{tau}"
                _write(tmp_path, d.name, *common, f"network.latency_ms={lat}", f"schedule.tau={tau}")
                summary = json.loads((d / "summary.json").read_text())
                summary["backend"] = backend  # the measured half, with what a real run adds
                if backend == "real":
                    summary.update(alpha_measured=summary["alpha"], c_measured=0.1, t_window_ms=30.0,
                                   target_nll_per_token=1.0, baseline_nll_per_token=1.0)
                (d / "summary.json").write_text(json.dumps(summary))
    md = build_report([tmp_path], tmp_path).read_text()
    section = md.split("## Decentralized speculative decoding (DSD)")[1].split("\n## ")[0]
    rows = [ln for ln in section.split("Effect of τ")[1].splitlines() if ln.startswith("| real") or ln.startswith("| sim")]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 0 for r in rows)
