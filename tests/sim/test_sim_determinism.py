"""Same seed ⇒ identical summary; the recorded rounds obey the schedule's invariants."""

from __future__ import annotations

from sim.runtime.engine import run
from testbed.results import build_summary
from tests.conftest import compose_exp


def test_same_seed_identical_summary() -> None:
    exp = compose_exp("workload.num_prompts=3", "workload.max_new_tokens=64")
    a = build_summary(exp, run(exp))
    b = build_summary(exp, run(exp))
    assert a == b
    exp2 = compose_exp("workload.num_prompts=3", "workload.max_new_tokens=64", "seed=1")
    assert build_summary(exp2, run(exp2)) != a


def test_sync_round_invariants() -> None:
    exp = compose_exp("workload.num_prompts=2", "workload.max_new_tokens=100", "schedule.gamma=5")
    rounds, requests, timeline = run(exp).recorder.frames()
    assert (rounds["drafted"] == 5).all()
    assert ((rounds["accepted"] >= 0) & (rounds["accepted"] <= 5)).all()
    assert (rounds["emitted"] <= rounds["accepted"] + 1).all()
    assert (requests["generated"] == 100).all()
    assert rounds.groupby("request_id")["emitted"].sum().eq(100).all()
    assert (rounds["end_s"] > rounds["start_s"]).all()
    # rounds of one request are back to back in time
    for _, g in rounds.groupby("request_id"):
        assert (g["start_s"].iloc[1:].values >= g["end_s"].iloc[:-1].values - 1e-12).all()
    assert set(timeline["resource"]) == {"draft", "target"}


def test_synthetic_sync_equals_ar_at_temperature_zero() -> None:
    common = ("acceptance=synthetic", "sampling.temperature=0", "workload.num_prompts=3",
              "workload.max_new_tokens=80")
    sync = run(compose_exp("schedule=sync", "schedule.gamma=4", *common)).recorder.frames()[1]
    ar = run(compose_exp("schedule=ar", *common)).recorder.frames()[1]
    for a, b in zip(sync["output_ids"], ar["output_ids"]):
        assert list(a) == list(b) and len(a) == 80


def test_synthetic_oracle_hits_configured_alpha() -> None:
    for temp in (0.0, 1.0):
        exp = compose_exp("acceptance=synthetic", "acceptance.alpha=0.7", f"sampling.temperature={temp}",
                          "workload.num_prompts=4", "workload.max_new_tokens=400", "schedule.gamma=3")
        s = build_summary(exp, run(exp))
        assert abs(s["alpha"] - 0.7) < 0.06, (temp, s["alpha"])
