"""validation.csv's interval columns: the prediction's (sim `<metric>_pi95`) and the
measurement's (real `<metric>_mean_ci95`, or from a one-pass run's own requests) beside the point
values, and whether the prediction lies inside the measurement's interval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from testbed.report import build_report
from testbed.report.sections_validate import validation_frame
from testbed.results import find_runs
from tests.testbed.report.test_validation_report import write_fake_run


def _add(run: Path, **fields: object) -> None:
    f = run / "summary.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **fields}))


def test_interval_columns_and_inside_share(tmp_path: Path) -> None:
    write_fake_run(tmp_path / "0", "real", "calibrate", decode_s=0.2, accepted=3)
    write_fake_run(tmp_path / "1", "real", "holdout", decode_s=1.0, accepted=1)  # 40 tok/s
    write_fake_run(tmp_path / "2", "sim", "holdout", decode_s=0.8, accepted=3)  # 50 tok/s
    # (the median's interval that real.repeats also reports is not the one a mean is held against)
    _add(tmp_path / "1", repeats=3, tokens_per_s_mean_ci95=[35.0, 52.0], tpot_ms_mean_ci95=[22.0, 26.0],
         tokens_per_s_ci95=[60.0, 70.0])
    _add(tmp_path / "2", tokens_per_s_pi95=[45.0, 56.0])
    val = validation_frame(find_runs([tmp_path])).set_index("metric")
    tps, tpot = val.loc["tokens_per_s"], val.loc["tpot_ms"]
    assert (tps["measured_low"], tps["measured_high"]) == (35.0, 52.0)
    assert (tps["predicted_low"], tps["predicted_high"]) == (45.0, 56.0)
    assert tps["inside"] == 1.0  # 50 within [35, 52]
    assert tpot["inside"] == 0.0  # the predicted 20 ms/token is outside [22, 26]
    assert math.isnan(val.loc["mean_accepted_len"]["inside"])  # no interval measured
    build_report([tmp_path], tmp_path / "report", figures=False)
    csv = pd.read_csv(tmp_path / "report" / "validation.csv")
    assert {"predicted_low", "predicted_high", "measured_low", "measured_high", "inside"} <= set(csv.columns)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "inside the measurement's 95% interval" in md and "100 % of 1" in md
    assert "over prompts × repeats" in md


def _write_real_run(path: Path, decode_s: list[float]) -> None:
    """A one-pass real run of len(decode_s) requests of 40 tokens each (no interval recorded)."""
    from testbed.recorder import RequestRecord, RunRecorder
    from testbed.results import RunResult, write_run
    from tests.conftest import compose_exp

    exp = compose_exp("backend=real", "pair=smollm2_135m+ngram3", "hardware=local", "workload=humaneval",
                      "workload.split=holdout", "schedule.gamma=4")
    rec = RunRecorder()
    for i, d in enumerate(decode_s):
        for r in range(20):
            rec.round(request_id=i, round_idx=r, start_s=0.0, end_s=0.0, drafted=4, checked=2,
                      accepted=1, emitted=2, verified_tokens=5, draft_s=0.0, target_s=0.0)
        rec.request(RequestRecord(request_id=i, prompt_id=f"HumanEval/{i}", prompt_len=100, output_ids=[],
            generated=40, prefill_s=0.1, decode_s=d, rounds=20))
    write_run(path, exp, RunResult(recorder=rec))


def test_a_one_pass_measurement_gets_the_interval_of_its_mean_over_its_prompts(tmp_path: Path) -> None:
    # per-request tokens/s: ten of 10, six of 60; mean 28.75, median 10
    _write_real_run(tmp_path / "1", [4.0] * 10 + [40 / 60] * 6)
    write_fake_run(tmp_path / "2", "sim", "holdout", decode_s=40 / 27.0, accepted=1)  # predicts 27 tok/s
    val = validation_frame(find_runs([tmp_path])).set_index("metric")
    tps = val.loc["tokens_per_s"]
    assert tps["measured"] == pytest.approx(28.75, abs=0.01)
    assert tps["measured_low"] < tps["measured"] < tps["measured_high"]
    assert tps["measured_low"] > 10.0  # the mean's interval: it leaves out the median, 10
    assert tps["measured_passes"] == 1 and tps["inside"] == 1.0
    build_report([tmp_path], tmp_path / "report", figures=False)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "1 of them over prompts only" in md


def test_error_stats_give_the_inside_share_per_family() -> None:
    from testbed.report.sections_validate import error_stats

    val = pd.DataFrame({"family": ["sync", "sync", "sync", "async", "async"],
                        "metric": ["tokens_per_s"] * 5, "error_pct": [1.0, -2.0, 3.0, -20.0, 15.0],
                        "inside": [1.0, 1.0, 0.0, 0.0, float("nan")]})
    stats = error_stats(val, by=("family", "metric")).set_index("family")
    assert stats.loc["sync", "inside_pct"] == pytest.approx(200 / 3)
    assert stats.loc["async", "inside_pct"] == 0.0  # the one with an interval was outside
    assert "inside_pct" not in error_stats(val.drop(columns="inside")).columns
