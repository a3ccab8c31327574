"""`+sweep=gpu_split backend=real`: the grid follows the backend and hardware, and the report
pairs predicted (sim) with measured (real) for every split (small fake results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hydra_plugins.specbed_sweeper.grids_sweeper import GridsSweeper
from testbed.app.preflight import command_pairs
from testbed.compose import register_configs
from testbed.report import build_report
from testbed.report.sections_split import split_pairs
from testbed.report.sections_validate import validation_frame
from testbed.results import find_runs
from tests.conftest import CONF, compose_exp, run_cli
from tests.testbed.app.test_sweeper import jobs

KEY = {"pair": "smollm2_135m+smollm2_draft", "hardware": "local", "nodes": 1, "workload": "humaneval",
       "temperature": 0.0, "seed": 0}
SPLITS = {  # split: (schedule, target, draft, gamma, predicted tok/s, measured tok/s, mal sim, mal real)
    "t1": ("async", 1, 1, 4, 30.0, 25.0, 3.0, 3.2),
    "sync": ("sync", 2, 2, 4, 20.0, 22.0, 2.5, 2.5),
    "sync_tree": ("sync_tree", 2, 2, 4, 24.0, 20.0, 3.5, 3.0),
    "ar": ("ar", 2, 0, 0, 10.0, 11.0, 1.0, 1.0),
}


def _fake(root: Path) -> None:
    for split, (sched, t, d, g, pred, meas, mal_s, mal_r) in SPLITS.items():
        for backend, tps, mal, wsplit in (("sim", pred, mal_s, "test"), ("real", meas, mal_r, "test"),
                                          ("real", 99.0, 9.0, "trace")):
            run = root / f"{split}_{backend}_{wsplit}"
            run.mkdir()
            (run / "summary.json").write_text(json.dumps({
                **KEY, "backend": backend, "schedule": sched, "target_gpus": t, "draft_gpus": d,
                "gamma": g, "workload_split": wsplit, "tokens_per_s": tps, "mean_accepted_len": mal}))


def test_report_pairs_predicted_with_measured_for_every_split(tmp_path: Path) -> None:
    _fake(tmp_path)
    pairs = split_pairs(validation_frame(find_runs([tmp_path])))
    assert list(pairs["split"]) == ["t1", "sync", "sync_tree", "ar"]
    for _, row in pairs.iterrows():
        _, _, _, _, pred, meas, mal_s, mal_r = SPLITS[row["split"]]
        assert (row["predicted_tokens_per_s"], row["measured_tokens_per_s"]) == (pred, meas)  # not the trace run
        assert row["tokens_per_s_error_pct"] == pytest.approx(100 * (pred - meas) / meas)
        assert row["tokens_per_verification_error_pct"] == pytest.approx(100 * (mal_s - mal_r) / mal_r)
    assert list(pairs.loc[pairs["best_predicted"], "split"]) == ["t1"]
    assert list(pairs.loc[pairs["best_measured"], "split"]) == ["t1"]
    md = build_report([tmp_path], tmp_path / "out", figures=False).read_text()
    section = md.split("## GPU split on this machine: predicted vs measured")[1].split("\n## ")[0]
    assert "| t1 | 1/1 | 30.00 ★ | 25.00 ★ | +20.0 |" in section
    assert "| sync_tree | 2/2 | 24.00 | 20.00 | +20.0 | +16.7 |" in section
    assert "NOT in the measured order" in section  # sim: sync_tree > sync, measured: sync > sync_tree


def _grid(*cli: str) -> tuple[str, list[list[str]]]:
    register_configs(command_pairs(["+sweep=gpu_split", *cli]))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["+sweep=gpu_split", *cli], return_hydra_config=True)
    sw = cfg.hydra.sweeper
    only = OmegaConf.select(cfg, "hydra.sweeper.only.0")
    return only, jobs(GridsSweeper(params=dict(sw.params), grids=OmegaConf.to_container(sw.grids), only=[only]))


def test_the_grid_follows_backend_and_hardware() -> None:
    only, real = _grid("backend=real")
    assert only == "real_local" and len(real) == 4 * 3
    seen = set()
    for job in real:
        exp = compose_exp("+sweep=gpu_split", "backend=real", *[o for o in job if not o.startswith("+validate")])
        assert exp.hardware.name == "local" and exp.real.threads == 1
        seen.add((exp.schedule.name, exp.schedule.tree, exp.placement.target_gpus,
                  exp.placement.draft_gpus if exp.schedule.name != "ar" else 0))
    assert seen == {("async", False, 1, 1), ("sync", False, 2, 2), ("sync", True, 2, 2), ("ar", False, 2, 0)}
    assert {j[-1] for j in real} == {"+validate=calibrate", "+validate=measure", "+validate=predict"}
    only, sim_local = _grid("hardware=local")
    assert only == "sim_local" and len(sim_local) == 4
    assert compose_exp("+sweep=gpu_split", "hardware=local", *sim_local[0]).sim.cost_model == "profile"
    assert _grid()[0] == "sim_h800x8" and len(_grid()[1]) == 27


@pytest.mark.slow
@pytest.mark.model
def test_gpu_split_real_sweep_end_to_end(tmp_path: Path) -> None:
    out = run_cli("+sweep=gpu_split", "backend=real", "workload.num_prompts=2",
                  "workload.max_new_tokens=32", f"hydra.sweep.dir={tmp_path}",
                  timeout=1800)  # real jobs take the host lock: another worker's real sweep goes first
    assert out.returncode == 0, out.stderr[-2000:]
    section = (tmp_path / "report.md").read_text().split("predicted vs measured")[1]
    for split in ("t1", "sync", "sync_tree", "ar"):
        assert f"| {split} |" in section


def test_a_hardware_without_a_split_grid_is_a_one_line_error() -> None:
    out = run_cli("+sweep=gpu_split", "hardware=h100x8", "hydra.sweep.dir=/tmp/never_written_gpu_split")
    assert out.returncode == 2 and "no grid named sim_h100x8" in out.stderr
    assert "Traceback" not in out.stderr and not Path("/tmp/never_written_gpu_split").exists()
