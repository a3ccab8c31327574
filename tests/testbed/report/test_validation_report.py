"""The validation report: sim and real joined on the experiment key, error_pct signed, the
calibrate split left out, validation.csv with the columns of docs/calibration.md."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.report import build_report
from testbed.report.sections_validate import sibling_replay_frame, validation_frame
from testbed.results import find_runs, write_run
from tests.conftest import compose_exp


def write_fake_run(path: Path, backend: str, split: str, decode_s: float, accepted: int,
                   gamma: int = 4, round_s: float = 0.0, schedule: str = "sync") -> None:
    """One request of 40 tokens decoded in `decode_s`; every round keeps `accepted` guesses and
    lasts `round_s`."""
    exp = compose_exp(f"backend={backend}", "pair=smollm2_135m+ngram3", "hardware=local",
                      "workload=humaneval", f"workload.split={split}",
                      *((f"schedule.gamma={gamma}",) if schedule != "ar" else ()), f"schedule={schedule}")
    rec = RunRecorder()
    generated, r = 0, 0
    while generated < 40:
        e = min(accepted + 1, 40 - generated)
        rec.round(request_id=0, round_idx=r, start_s=r * round_s, end_s=(r + 1) * round_s,
                  drafted=gamma, checked=accepted + 1, accepted=accepted, emitted=e,
                  verified_tokens=gamma + 1, draft_s=0.0, target_s=0.0)
        generated += e
        r += 1
    rec.request(RequestRecord(request_id=0, prompt_id="HumanEval/0", prompt_len=100, output_ids=[],
        generated=40, prefill_s=0.1, decode_s=decode_s, rounds=r))
    write_run(path, exp, RunResult(recorder=rec))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    write_fake_run(tmp_path / "0", "real", "calibrate", decode_s=0.2, accepted=3)  # the trace source
    write_fake_run(tmp_path / "1", "real", "holdout", decode_s=1.0, accepted=1)  # measured: 40 tok/s
    write_fake_run(tmp_path / "2", "sim", "holdout", decode_s=0.8, accepted=3)  # predicted: 50 tok/s
    write_fake_run(tmp_path / "3", "real", "holdout", decode_s=1.0, accepted=1, gamma=2)  # no sim partner
    return tmp_path


def test_join_and_signed_error(sweep: Path) -> None:
    val = validation_frame(find_runs([sweep]))
    assert set(val["gamma"]) == {4}  # γ=2 has no prediction; the calibrate run is no measurement
    row = val.set_index("metric").loc["tokens_per_s"]
    assert row["measured"] == pytest.approx(40.0) and row["predicted"] == pytest.approx(50.0)
    assert row["error_pct"] == pytest.approx(25.0)  # over-prediction is positive
    tpot = val.set_index("metric").loc["tpot_ms"]
    assert tpot["error_pct"] == pytest.approx(-20.0)
    mal = val.set_index("metric").loc["mean_accepted_len"]
    assert (mal["predicted"], mal["measured"]) == (pytest.approx(4.0), pytest.approx(2.0))


def test_report_writes_validation_csv_and_parity_plot(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    md = build_report([sweep], out).read_text()
    csv = pd.read_csv(out / "validation.csv")
    assert list(csv.columns) == ["schedule", "pair", "hardware", "target_gpus", "draft_gpus", "nodes",
                                 "gamma", "workload", "temperature", "seed", "lookahead", "split", "dsd_point", "load_point", "family", "metric",
                                 "predicted", "measured", "error_pct", "predicted_low",
                                 "predicted_high", "measured_low", "measured_high", "measured_passes", "inside"]
    assert {"tokens_per_s", "tpot_ms", "mean_accepted_len"} <= set(csv["metric"])
    assert (out / "parity.png").stat().st_size > 0
    assert "median |error| 25.0 %" in md and "NOT met" in md


def test_no_validation_section_without_both_backends(tmp_path: Path) -> None:
    write_fake_run(tmp_path / "a", "real", "holdout", decode_s=1.0, accepted=1)
    assert validation_frame(find_runs([tmp_path])).empty
    build_report([tmp_path], tmp_path / "r")
    assert not (tmp_path / "r" / "validation.csv").exists()


def test_real_predicting_real_is_the_timing_noise(tmp_path: Path) -> None:
    """The trace run's round times replayed on the measured run's rounds: 10 rounds of 20 ms
    there, 12 ms per round here (same γ, same acceptance) -> predicted 40/(10·0.020) = 200 tok/s
    against 40/(10·0.012) = 333 tok/s measured: -40 %."""
    write_fake_run(tmp_path / "0", "real", "trace", decode_s=0.2, accepted=3, round_s=0.020)
    write_fake_run(tmp_path / "1", "real", "test", decode_s=0.12, accepted=3, round_s=0.012)
    write_fake_run(tmp_path / "2", "sim", "test", decode_s=0.2, accepted=3)
    runs = find_runs([tmp_path])
    noise = sibling_replay_frame(runs, validation_frame(runs))
    assert len(noise) == 1 and noise["split"].iloc[0] == "test"
    assert noise["measured"].iloc[0] == pytest.approx(40 / 0.12)
    assert noise["predicted"].iloc[0] == pytest.approx(200.0)
    assert noise["error_pct"].iloc[0] == pytest.approx(-40.0)
    md = build_report([tmp_path], tmp_path / "report").read_text()
    assert "Real predicting real" in md and (tmp_path / "report" / "validation_noise.csv").exists()


def test_errors_per_schedule_family_with_p90(sweep: Path, tmp_path: Path) -> None:
    write_fake_run(sweep / "4", "real", "holdout", decode_s=1.0, accepted=0, schedule="ar")
    write_fake_run(sweep / "5", "sim", "holdout", decode_s=0.9, accepted=0, schedule="ar")
    val = validation_frame(find_runs([sweep]))
    assert set(val["family"]) == {"sync", "ar"}
    md = build_report([sweep], tmp_path / "r").read_text()
    table = md.split("Per schedule family")[1].split("\n\n", 2)[1]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in table.splitlines()[2:]}
    assert ("sync", "tokens_per_s") in rows and ("ar", "tokens_per_s") in rows
    ar_tps = val[(val["family"] == "ar") & (val["metric"] == "tokens_per_s")]["error_pct"]
    assert ar_tps.iloc[0] == pytest.approx(100 * (1.0 / 0.9 - 1))  # ar: 40 tok in 0.9 s vs 1.0 s


def _load_run(path: Path, backend: str, clients: int, finish_s: float) -> None:
    """Two requests of 11 tokens under a closed loop of ``clients``, both answered at ``finish_s``."""
    exp = compose_exp(f"backend={backend}", "pair=smollm2_135m+ngram3", "hardware=local", "workload=humaneval",
                      "workload.split=holdout", "schedule=sync", "schedule.gamma=2",
                      f"workload.concurrency={clients}")
    rec = RunRecorder()
    for rid in range(2):
        rec.round(request_id=rid, round_idx=0, start_s=0.0, end_s=finish_s, drafted=2, checked=1, accepted=0,
                  emitted=11, verified_tokens=3, draft_s=0.0, target_s=finish_s)
        rec.request(RequestRecord(request_id=rid, prompt_id=f"HumanEval/{rid}", prompt_len=100, output_ids=[],
                                  generated=11, prefill_s=0.1, decode_s=finish_s - 0.1, rounds=1, arrival_s=0.0,
                                  queue_s=0.0, first_token_s=0.1, finish_s=finish_s))
        rec.span("target", "verify", 0.0, finish_s, request_id=-1, round_idx=0, batch=2)
    write_run(path, exp, RunResult(recorder=rec))


def test_points_under_load_join_by_their_load_and_compare_throughput_and_tpot(tmp_path: Path) -> None:
    _load_run(tmp_path / "0", "real", 2, finish_s=1.1)  # TPOT (1.1 - 0.1) / 10 = 100 ms
    _load_run(tmp_path / "1", "sim", 2, finish_s=1.0)  # 90 ms: -10 %
    _load_run(tmp_path / "2", "real", 4, finish_s=2.1)
    _load_run(tmp_path / "3", "sim", 4, finish_s=2.1)
    val = validation_frame(find_runs([tmp_path]))
    tpot = val[val["metric"] == "tpot_ms_p50"].set_index("load_point")["error_pct"]
    assert tpot.to_dict() == {"2 clients": pytest.approx(-10.0), "4 clients": pytest.approx(0.0)}
    assert set(val["family"]) == {"sync under load"}
    assert {"throughput_tok_s", "tpot_ms_p90"} <= set(val["metric"])
    md = build_report([tmp_path], tmp_path / "report").read_text()
    assert "Under load: median |error|" in md and "tpot_ms_p50 5.0 %" in md
