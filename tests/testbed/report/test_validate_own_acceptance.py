"""The validation report's error split (testbed/report/validate_own_acceptance.py): every
prediction made again on the measured prompts' own acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import compose_exp
from tests.sim.test_cost_profile import make_profile

BASE = ("pair=smollm2_135m+smollm2_exit10", "hardware=local", "schedule.gamma=4", "workload=humaneval",
        "workload.num_prompts=1", "workload.max_new_tokens=16")


def _real_run(path: Path, split: str, accepted: int) -> None:
    """A recorded real run whose every round accepts ``accepted`` of 4 drafted tokens."""
    from testbed.recorder import RequestRecord, RunRecorder, RunResult
    from testbed.results import write_run

    rec = RunRecorder()
    for r in range(16 // (accepted + 1)):
        rec.round(request_id=0, round_idx=r, start_s=0.01 * r, end_s=0.01 * (r + 1), drafted=4,
                  checked=min(4, accepted + 1), accepted=accepted, emitted=accepted + 1,
                  verified_tokens=5, draft_s=0.004, target_s=0.006)
    rec.request(RequestRecord(request_id=0, prompt_id="HumanEval/0", prompt_len=100, output_ids=[],
        generated=16, prefill_s=0.1, decode_s=0.01 * (16 // (accepted + 1)), rounds=16 // (accepted + 1)))
    write_run(path, compose_exp("backend=real", *BASE, f"workload.split={split}"), RunResult(recorder=rec))


def test_the_prediction_is_made_again_on_the_measured_runs_own_acceptance(tmp_path: Path) -> None:
    """Trace prompts accept 1 of 4, the measured ones 3 of 4: the standalone prediction replays
    the trace (2 tokens per verification), the own-acceptance one the measured run's (4)."""
    from sim.runtime.engine import run as simulate
    from testbed.config_validate import validate
    from testbed.report.sections_validate import family, run_split, validation_key
    from testbed.report.validate_own_acceptance import own_acceptance_frame, own_acceptance_lines
    from testbed.results import find_runs, write_run
    from testbed.workloads import TRACE_SPLITS

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(make_profile()))
    sweep = tmp_path / "sweep"
    _real_run(sweep / "0", "trace", accepted=1)
    _real_run(sweep / "1", "test", accepted=3)
    pred = validate(compose_exp(*BASE, "sim.cost_model=profile", f"sim.profile_path={profile}",
                                "acceptance=trace", f"acceptance.trace_path={sweep}", "workload.split=test"))
    write_run(sweep / "2", pred, simulate(pred))
    runs = find_runs([sweep])
    frame = own_acceptance_frame(runs, key_of=validation_key, family_of=family,
                                 is_measurement=lambda r: run_split(r) not in TRACE_SPLITS)
    assert len(frame) == 1
    row = frame.iloc[0]
    standalone_len = next(r.summary["mean_accepted_len"] for r in runs if r.summary["backend"] == "sim")
    assert standalone_len == pytest.approx(2.0)  # the trace's acceptance
    assert row["own_accepted_len"] == pytest.approx(row["measured_accepted_len"]) == pytest.approx(4.0)
    assert row["own_acceptance"] > 1.5 * row["standalone"]  # twice the tokens per round, same costs
    assert row["own_acceptance_error_pct"] == pytest.approx(100 * (row["own_acceptance"] / row["measured"] - 1))
    text = "\n".join(own_acceptance_lines(frame, "validation_own_acceptance.csv"))
    assert "| sync |" in text and "own acceptance" in text.lower()
