"""validation.csv's interval columns: the prediction's (sim `<metric>_pi95`) and the
measurement's (real `<metric>_ci95`) beside the point values, and whether the prediction lies
inside the measurement's interval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from testbed.report import build_report
from testbed.report.sections_validate import validation_frame
from testbed.results import find_runs
from tests.test_validation_report import write_fake_run


def _add(run: Path, **fields: object) -> None:
    f = run / "summary.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **fields}))


def test_interval_columns_and_inside_share(tmp_path: Path) -> None:
    write_fake_run(tmp_path / "0", "real", "calibrate", decode_s=0.2, accepted=3)
    write_fake_run(tmp_path / "1", "real", "holdout", decode_s=1.0, accepted=1)  # 40 tok/s
    write_fake_run(tmp_path / "2", "sim", "holdout", decode_s=0.8, accepted=3)  # 50 tok/s
    _add(tmp_path / "1", repeats=3, tokens_per_s_ci95=[35.0, 52.0], tpot_ms_ci95=[22.0, 26.0])
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
