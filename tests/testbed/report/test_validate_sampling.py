"""The acceptance transfer between prompt splits: its expected size from the between-prompt
spread, the prompts per split that keep it within the goals, and the report's table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.report import build_report
from testbed.report.sections_validate import validation_frame
from testbed.report.validate_sampling import (
    Z_P90,
    expected_transfer_pct,
    pooled_cv,
    prompts_needed,
    sampling_frame,
)
from testbed.results import find_runs, write_run
from tests.conftest import compose_exp


@pytest.mark.parametrize(("n_trace", "n_test", "cv"), [(4, 4, 0.10), (8, 4, 0.05), (16, 16, 0.2)])
def test_expected_transfer_matches_sampled_prompt_splits(n_trace: int, n_test: int, cv: float) -> None:
    """Per-prompt values with a known CV, two disjoint samples drawn 20,000 times (fixed seed): the
    median and the P90 of |relative difference of their means| are what the formula says (±6 %)."""
    rng = np.random.default_rng(7)
    mean = 1.6
    trace = rng.normal(mean, cv * mean, (20_000, n_trace)).mean(axis=1)
    test = rng.normal(mean, cv * mean, (20_000, n_test)).mean(axis=1)
    rel = np.abs(100.0 * (trace - test) / test)
    assert np.median(rel) == pytest.approx(expected_transfer_pct(cv, n_trace, n_test), rel=0.06)
    assert np.quantile(rel, 0.9) == pytest.approx(expected_transfer_pct(cv, n_trace, n_test, Z_P90), rel=0.06)


@pytest.mark.parametrize(("cv", "goal", "z"), [(0.08, 5.0, 0.674), (0.19, 10.0, Z_P90), (0.02, 5.0, 0.674)])
def test_prompts_needed_is_the_smallest_size_that_meets_the_goal(cv: float, goal: float, z: float) -> None:
    n = prompts_needed(cv, goal, z)
    assert expected_transfer_pct(cv, n, n, z) <= goal + 1e-9
    assert n == 1 or expected_transfer_pct(cv, n - 1, n - 1, z) > goal


def test_pooled_cv_is_the_spread_around_each_samples_own_mean() -> None:
    a = np.array([1.0, 2.0, 3.0])
    shifted = pooled_cv(a, a + 10.0)  # the means differ by 10: not spread
    assert shifted == pytest.approx(1.0 / np.concatenate([a, a + 10.0]).mean())
    assert np.isnan(pooled_cv(np.array([1.0]), np.array([2.0])))


def write_run_with_prompts(path: Path, backend: str, split: str, accepted: list[int],
                           decode_s: float = 1.0) -> None:
    """One request per entry of `accepted`, 40 tokens each, every round keeping that many guesses."""
    exp = compose_exp(f"backend={backend}", "pair=smollm2_135m+ngram3", "hardware=local",
                      "workload=humaneval", f"workload.split={split}", "schedule.gamma=4")
    rec = RunRecorder()
    for rid, acc in enumerate(accepted):
        generated, r = 0, 0
        while generated < 40:
            e = min(acc + 1, 40 - generated)
            rec.round(request_id=rid, round_idx=r, start_s=0.0, end_s=0.0, drafted=4, checked=acc + 1,
                      accepted=acc, emitted=e, verified_tokens=5, draft_s=0.0, target_s=0.0)
            generated, r = generated + e, r + 1
        rec.request(RequestRecord(request_id=rid, prompt_id=f"HumanEval/{rid}", prompt_len=100,
            output_ids=[], generated=40, prefill_s=0.1, decode_s=decode_s, rounds=r))
    write_run(path, exp, RunResult(recorder=rec))


def test_report_states_the_transfer_and_the_prompts_it_needs(tmp_path: Path) -> None:
    """Trace prompts keep 1 and 3 guesses a round, test prompts 3 and 3: 40 tokens in 20 and 10
    rounds (2 and 4 tokens per verification) against 4 and 4; the transfer is (3 − 4)/4 = −25 %."""
    write_run_with_prompts(tmp_path / "0", "real", "trace", [1, 3])
    write_run_with_prompts(tmp_path / "1", "real", "test", [3, 3])
    write_run_with_prompts(tmp_path / "2", "sim", "test", [1, 3])
    runs = find_runs([tmp_path])
    frame = sampling_frame(runs, validation_frame(runs))
    assert len(frame) == 1 and frame["family"].iloc[0] == "sync"
    row = frame.iloc[0]
    assert (row["n_trace"], row["n_test"]) == (2, 2)
    assert row["transfer_pct"] == pytest.approx(-25.0)
    cv = np.sqrt(((2 - 3) ** 2 + (4 - 3) ** 2) / 2) / 3.5  # pooled around 3 and 4, over the mean 3.5
    assert row["cv"] == pytest.approx(cv)
    assert row["expected_median_pct"] == pytest.approx(100 * 0.674 * cv)
    out = tmp_path / "report"
    md = build_report([tmp_path], out).read_text()
    assert "Acceptance transfer between prompt splits" in md
    table = md.split("Acceptance transfer between prompt splits")[1].split("\n\n")[1]
    cells = [c.strip() for c in table.splitlines()[2].split("|")[1:-1]]
    assert cells[0] == "sync" and int(cells[6]) == max(prompts_needed(cv, 5.0), prompts_needed(cv, 10.0, Z_P90))
    assert len(pd.read_csv(out / "validation_sampling.csv")) == 1
