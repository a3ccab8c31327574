"""sim.profile_drift=run_probe (sim/cost/run_probe.py): a prediction takes its level from the probe
forward the measured run of the same experiment timed in its own processes before decoding."""

from __future__ import annotations

import json
import math

import pytest

from sim.cost.profile import ProfileCost
from testbed.config import ConfigError
from testbed.config_validate import validate
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.sim.test_cost_profile import make_profile

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
            rec.request(RequestRecord(request_id=rid, prompt_id=f"HumanEval/{rid}", prompt_len=100,
                output_ids=[], generated=24, prefill_s=0.1, decode_s=1.0, rounds=12))
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


@pytest.mark.parametrize("temperature", ["0.0", "1.0"])
def test_the_drafts_probe_is_compared_without_the_pick_its_table_includes(tmp_path, temperature: str) -> None:  # type: ignore[no-untyped-def]
    """The draft's table times forward + pick (argmax, or a draw at T = 1); the run's probe times
    the forward alone. A machine exactly as profiled must give the draft a factor of 1 at both
    temperatures (it was ~0.7 at T = 1 when the draw was left in the reference)."""
    from tests.sim.test_cost_profile import DRAFT

    profile = make_profile()
    pick = profile["models"]["smollm2_135m"]["pick"]
    fwd = profile["models"]["smollm2_exit10"]["forward"]["greedy"]
    step = {cls: [[v - pick["greedy"] + pick[cls] for v in row] for row in DRAFT] for cls in pick}
    profile["models"]["smollm2_exit10"]["forward"] = {cls: {**fwd, "seconds": rows} for cls, rows in step.items()}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    pair = "smollm2_135m+smollm2_exit10"
    run = (f"pair={pair}", f"sampling.temperature={temperature}")
    common = (*BASE, *run)
    forward_alone = DRAFT[0][0] - pick["greedy"]  # k = 1 at context 64: the probe's forward
    target = ProfileCost(compose_exp(*common, "sim.cost_model=profile", f"sim.profile_path={path}"))
    assert target.probe_seconds("draft") == pytest.approx(forward_alone)
    _write_real_run(tmp_path / "runs" / "0", *run, "workload.split=test",
                    probes={"probe_target_s": target.probe_seconds("target"), "probe_draft_s": forward_alone})
    drifted = ProfileCost(compose_exp(*common, "sim.cost_model=profile", f"sim.profile_path={path}",
                                      "acceptance=trace", f"acceptance.trace_path={tmp_path / 'runs'}",
                                      "workload.split=test", "sim.profile_drift=run_probe"))
    assert drifted.drift_by_role == pytest.approx({"target": 1.0, "draft": 1.0})


def test_small_verification_sizes_take_their_own_probes_factor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run that probed the target at 3 tokens too: a 3-token forward takes that factor (not the
    1-to-8 interpolation, which missed a shape that moved by 7 % on this host), sizes between
    probes are log-linear between the nearest two."""
    pair = "smollm2_135m+smollm2_exit10"
    plain = ProfileCost(_predict(tmp_path, pair))
    _write_real_run(tmp_path / "runs" / "0", f"pair={pair}", "workload.split=test",
                    probes={"probe_target_s": 1.3 * plain.probe_seconds("target"),
                            "probe_target_k3_s": 1.5 * plain.probe_seconds("target", 3),
                            "probe_target_k8_s": 1.1 * plain.probe_seconds("target", 8),
                            "probe_draft_s": plain.probe_seconds("draft")})
    drifted = ProfileCost(_predict(tmp_path, pair, "sim.profile_drift=run_probe"))
    at2 = 1.3 + (1.5 - 1.3) * math.log(2) / math.log(3)
    at5 = 1.5 + (1.1 - 1.5) * math.log(5 / 3) / math.log(8 / 3)
    for k, factor in ((1, 1.3), (2, at2), (3, 1.5), (5, at5), (8, 1.1), (12, 1.1)):
        assert drifted.forward("target", k, 300) == pytest.approx(factor * plain.forward("target", k, 300))


def test_a_run_probes_the_target_at_every_size_the_prediction_reads() -> None:
    """real/calibrate/probe_forward.target_probes on a tiny random model: RunProbe's summary has a reading
    for every size sim/cost/run_probe.py reads, under the field name it reads."""
    from real.calibrate.probe_forward import RunProbe, role_probes, target_probes
    from real.model.decoder import ModelArgs
    from sim.cost.run_probe import FIELDS
    from testbed.spec.sampling import SamplingParams
    from tests.helpers.real_models import TINY, tiny

    model = tiny(args=ModelArgs(**{**TINY.__dict__, "max_seq_len": 128}))
    probe = RunProbe(target_probes(model, SamplingParams()))
    probe.take(0)
    fields = probe.fields()
    assert {FIELDS[p] for p in FIELDS if p.startswith("target")} == set(fields) - {"probe_points"}
    assert all(fields[f] > 0 for f in fields)
    # with an early-exit draft: its one step, and two back to back
    from real.model.drafts import EarlyExitDraft

    draft = EarlyExitDraft(model, exit_layer=2, params=SamplingParams())
    probe = RunProbe(role_probes(model, draft, SamplingParams()))
    probe.take(0)
    assert {"probe_draft_s", "probe_draft_pair_s"} <= set(probe.fields())


def test_draft_steps_after_the_first_take_the_warm_step_ratio(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two draft steps back to back took 1.6 single ones in the measured run's probe: a chain draft
    phase charges its first forward as the table says and each later one at 0.8 of it."""
    pair = "smollm2_135m+smollm2_exit10"
    plain = ProfileCost(_predict(tmp_path, pair))
    one = plain.probe_seconds("draft")
    _write_real_run(tmp_path / "runs" / "0", f"pair={pair}", "workload.split=test",
                    probes={"probe_target_s": plain.probe_seconds("target"), "probe_draft_s": one,
                            "probe_draft_pair_s": 1.6 * one})
    warm = ProfileCost(_predict(tmp_path, pair, "sim.profile_drift=run_probe"))
    assert warm.warm_draft == pytest.approx(0.8)
    first = plain.forward("draft", 2, 200)
    rest = sum(plain.forward("draft", 1, 202 + i - 1) for i in range(1, 5))
    assert plain.draft_chain(2, 5, 202) == pytest.approx(first + rest)
    assert warm.draft_chain(2, 5, 202) == pytest.approx(first + 0.8 * rest)


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
    from sim.runtime.engine import run

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
    """real/calibrate/probe_forward.RunProbe: at most MAX_READINGS readings a run, spread over its
    requests; the summary field is the mean without the lowest and highest reading."""
    from real.calibrate.probe_forward import MAX_READINGS, RunProbe

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
