"""sim.profile_drift=run_probe (sim/run_probe.py): a prediction takes its level from the probe
forward the measured run of the same experiment timed in its own processes before decoding."""

from __future__ import annotations

import json
import math

import pytest

from sim.cost_profile import ProfileCost
from testbed.config import ConfigError, validate
from testbed.recorder import RunRecorder, RunResult
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.test_cost_profile import make_profile

BASE = ("hardware=local", "schedule.gamma=3", "workload=humaneval", "workload.num_prompts=2",
        "workload.max_new_tokens=24")


def _write_real_run(run_dir, *overrides: str, probes: dict, rounds: bool = False) -> None:  # type: ignore[no-untyped-def]
    exp = compose_exp("backend=real", *BASE, *overrides)
    rec = RunRecorder()
    if rounds:  # an acceptance trace: every round keeps 1 of 3 guesses
        for rid in range(2):
            for r in range(12):
                rec.round(request_id=rid, round_idx=r, start_s=0.0, end_s=0.0, drafted=3, checked=2,
                          accepted=1, emitted=2, verified_tokens=4, draft_s=0.01, target_s=0.03)
            rec.request(rid, f"HumanEval/{rid}", 100, [], 24, 0.1, 1.0, 12)
    write_run(run_dir, exp, RunResult(recorder=rec, extra=probes))


def _predict(tmp_path, pair: str, *extra: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make_profile()))
    return compose_exp(*BASE, f"pair={pair}", "sim.cost_model=profile", f"sim.profile_path={path}",
                       "acceptance=trace", f"acceptance.trace_path={tmp_path / 'runs'}",
                       "workload.split=test", *extra)


def test_each_role_is_scaled_to_the_measured_runs_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pair = "smollm2_135m+smollm2_exit10"
    plain = ProfileCost(_predict(tmp_path, pair))
    probe = {role: plain.probe_seconds(role) for role in ("target", "draft")}
    # the measured run found one-token forwards 1.3x (target) and 0.8x (draft) the profile's
    # times, the target's 8-token forward 1.1x; another γ's run and this experiment's
    # trace-split run must not be taken for it
    _write_real_run(tmp_path / "runs" / "0", f"pair={pair}", "workload.split=test",
                    probes={"probe_target_s": 1.3 * probe["target"], "probe_draft_s": 0.8 * probe["draft"],
                            "probe_target_k8_s": 1.1 * plain.probe_seconds("target", 8)})  # no draft_k8
    _write_real_run(tmp_path / "runs" / "1", f"pair={pair}", "workload.split=test", "schedule.gamma=5",
                    probes={"probe_target_s": 9.0, "probe_draft_s": 9.0})
    _write_real_run(tmp_path / "runs" / "2", f"pair={pair}", "workload.split=trace",
                    probes={"probe_target_s": 9.0, "probe_draft_s": 9.0})
    drifted = ProfileCost(_predict(tmp_path, pair, "sim.profile_drift=run_probe"))
    assert drifted.drift_by_role == pytest.approx({"target": 1.3, "draft": 0.8})
    assert drifted.drift_run == tmp_path / "runs" / "0"
    at4 = 1.3 + (1.1 - 1.3) * math.log(4) / math.log(8)  # log-linear in k between the probes
    for role, k, factor in (("target", 1, 1.3), ("target", 4, at4), ("target", 8, 1.1), ("target", 16, 1.1),
                            ("draft", 1, 0.8), ("draft", 3, 0.8)):
        assert drifted.forward(role, k, 300) == pytest.approx(factor * plain.forward(role, k, 300))


def test_the_ngram_draft_takes_the_targets_factor_and_a_missing_run_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pair = "smollm2_135m+ngram3"
    exp = _predict(tmp_path, pair, "sim.profile_drift=run_probe")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="sim.profile_drift=.*run_probe.*a real run of this experiment"):
        ProfileCost(exp)
    t = ProfileCost(_predict(tmp_path, pair)).probe_seconds("target")
    _write_real_run(tmp_path / "runs" / "0", f"pair={pair}", "workload.split=test",
                    probes={"probe_target_s": 2.0 * t})
    assert ProfileCost(exp).drift_by_role == pytest.approx({"target": 2.0, "draft": 2.0})
    with pytest.raises(ConfigError, match="sim.profile_drift.*acceptance=trace"):
        validate(compose_exp(*BASE, "sim.cost_model=profile", "sim.profile_drift=run_probe"))


def test_the_predictions_ar_baseline_takes_its_drift(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real run's `ar` baseline ran in its processes: the simulated baseline is scaled alike
    (it has no real run of its own to look up), by the one-token factor."""
    from sim.engine import run

    pair = "smollm2_135m+smollm2_exit10"
    plain_exp = _predict(tmp_path, pair)
    t = ProfileCost(plain_exp).probe_seconds("target")
    _write_real_run(tmp_path / "runs" / "0", f"pair={pair}", "workload.split=trace", rounds=True, probes={})
    _write_real_run(tmp_path / "runs" / "1", f"pair={pair}", "workload.split=test",
                    probes={"probe_target_s": 1.5 * t, "probe_target_k8_s": 9.0})
    plain = run(plain_exp)
    drifted = run(_predict(tmp_path, pair, "sim.profile_drift=run_probe"))
    assert drifted.extra["profile_drift_factor"] == pytest.approx(1.5)

    base_plain, base_drifted = plain.baseline.frames()[0], drifted.baseline.frames()[0]
    assert base_drifted.target_s.sum() == pytest.approx(1.5 * base_plain.target_s.sum())


def test_a_run_probe_reads_before_every_nth_request_and_trims_outliers() -> None:
    """real/probe_forward.RunProbe: at most MAX_READINGS readings a run, spread over its
    requests; the summary field is the mean without the lowest and highest reading."""
    from real.probe_forward import MAX_READINGS, RunProbe

    calls: list[str] = []
    probe = RunProbe({"target": lambda: calls.append("t"), "draft": lambda: calls.append("d")},
                     requests=3 * MAX_READINGS)
    taken = [i for i in range(3 * MAX_READINGS) if probe.take(i) is not None]
    assert taken == list(range(0, 3 * MAX_READINGS, 3))
    assert calls[:2] == ["t", "d"]  # interleaved per repeat
    probe.readings = [{"target": v, "draft": 1.0} for v in (0.020, 0.021, 0.022, 0.023, 0.090)]
    fields = probe.fields()
    assert fields["probe_target_s"] == pytest.approx(0.022)  # 0.020 and the 0.090 burst dropped
    assert fields["probe_draft_s"] == pytest.approx(1.0) and fields["probe_points"] == 5
    assert RunProbe({}).fields() == {}
