"""The `profile` cost model: exact on the measured grid, monotone between grid points, one clear
error when no profile exists; calibration's robust smoothing."""

from __future__ import annotations

import json

import pytest

from sim.cost.profile import ProfileCost
from sim.cost.profile_tables import CALIBRATE_CMD, SCHEMA, interp1
from testbed.config import ConfigError
from testbed.config_validate import validate
from testbed.paths import timed_code_digest
from tests.conftest import compose_exp, run_cli

K = [1, 2, 4, 8]
CTX = [64, 256, 1024]
# strictly increasing in k and context, not linear in either (interpolation must not assume it)
TARGET = [[0.020 + 0.001 * k ** 1.5 + 2e-6 * c * (1 + k / 8) for k in K] for c in CTX]
DRAFT = [[0.002 + 0.0005 * k + 1e-6 * c for k in K[:2]] for c in CTX]


def make_profile() -> dict:
    def fwd(rows, ks):  # type: ignore[no-untyped-def]
        return {"k": ks, "context": CTX, "seconds": rows}

    return {
        "schema": SCHEMA, "hardware": "local", "threads": 2, "dtype": "fp32", "code": timed_code_digest(),
        "models": {
            "smollm2_135m": {"kind": "transformer", "layers": 30,
                             "forward": {"greedy": fwd(TARGET, K),
                                         "sample": fwd([[2 * v for v in r] for r in TARGET], K)},
                             "accept": {"greedy": {"k": K, "seconds": [1e-4, 2e-4, 3e-4, 4e-4]}},
                             "pick": {"greedy": 5e-5, "sample": 7e-4},
                             "prefill": {"prompt_len": [16, 256], "seconds": [0.03, 0.2]}},
            "smollm2_exit10": {"kind": "early_exit", "layers": 10,
                               "forward": {"greedy": fwd(DRAFT, K[:2])}},
            "ngram3": {"kind": "ngram", "propose": {"greedy": {"context": CTX, "seconds": [1e-5, 2e-5, 5e-5]}}},
        },
    }


def cost(*overrides: str) -> ProfileCost:
    exp = compose_exp("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile",
                      *overrides)
    return ProfileCost(exp, profile=make_profile())


def test_exact_on_grid_points() -> None:
    c = cost()
    accept = dict(zip(K, [1e-4, 2e-4, 3e-4, 4e-4]))
    for ci, ctx in enumerate(CTX):
        for ki, k in enumerate(K):
            assert c.forward("target", k, ctx) == pytest.approx(TARGET[ci][ki] + accept[k], rel=1e-12)
        for ki, k in enumerate(K[:2]):
            assert c.forward("draft", k, ctx) == pytest.approx(DRAFT[ci][ki], rel=1e-12)
    assert c.prefill("target", 256) == pytest.approx(0.2)
    assert c.prefill("draft", 256) == 0.0  # early exit: the target's prefill is its prefill


def test_monotone_and_between_neighbours_off_grid() -> None:
    c = cost()
    for ctx in (64, 100, 300, 700, 1024):
        row = [c.forward("target", k, ctx) for k in range(1, 9)]
        assert all(b >= a for a, b in zip(row, row[1:])), row
    for k in (1, 3, 5, 8):
        col = [c.forward("target", k, ctx) for ctx in range(64, 1025, 37)]
        assert all(b >= a for a, b in zip(col, col[1:])), col
    # bilinear: a cell's interior lies between its corners
    lo = c.forward("target", 2, 64)
    hi = c.forward("target", 4, 256)
    assert lo < c.forward("target", 3, 150) < hi


def test_temperature_class_and_ar_pick() -> None:
    greedy, sampled = cost(), cost("sampling.temperature=1.0")
    assert sampled.forward("target", 4, 256) - 3e-4 == pytest.approx(2 * TARGET[1][2], rel=1e-12)
    assert greedy.forward("target", 4, 256) - 3e-4 == pytest.approx(TARGET[1][2], rel=1e-12)
    ar = cost("schedule=ar")  # `ar` picks from p (argmax) instead of running Algorithm 1
    assert ar.forward("target", 1, 64) == pytest.approx(TARGET[0][0] + 5e-5, rel=1e-12)


def test_ngram_lookup_is_spread_over_the_rounds_forwards() -> None:
    exp = compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                      "schedule.gamma=4")
    c = ProfileCost(exp, profile=make_profile())
    assert c.forward("draft", 1, 256) == pytest.approx(2e-5 / 4)


def test_a_pipeline_stage_costs_its_share_of_the_weights_the_last_the_lm_head() -> None:
    """Two stages of the 30-layer target: together the whole forward's layers and head; the last
    stage, which also reads the LM head (a fifth of SmolLM2-135M's weights), costs more."""
    c = cost("schedule=decentralized", "placement.nodes=2")
    whole = c.forward("target", 4, 256)
    first = c.forward("target", 4, 256, layers=(0, 15))
    last = c.forward("target", 4, 256, layers=(15, 30))
    assert first + last == pytest.approx(whole, rel=1e-12)
    accept = 3e-4  # Algorithm 1 over 4 tokens: on the last stage only
    assert first / (whole - accept) == pytest.approx(0.3947, abs=1e-4)  # 39.5 % of the weights
    assert (last - accept) / (whole - accept) == pytest.approx(0.6053, abs=1e-4)


def test_interp_extrapolates_linearly() -> None:
    assert interp1(3.0, [1.0, 2.0], [10.0, 20.0]) == pytest.approx(30.0)
    assert interp1(0.0, [1.0, 2.0], [10.0, 20.0]) == pytest.approx(0.0)


def test_missing_profile_and_missing_model_are_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    exp = compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                      f"sim.profile_path={tmp_path / 'none.json'}")
    with pytest.raises(ConfigError, match="sim.profile_path") as e:
        ProfileCost(exp)
    assert CALIBRATE_CMD in str(e.value)
    prof = make_profile()
    del prof["models"]["ngram3"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    exp.sim.profile_path = str(path)
    with pytest.raises(ConfigError, match="pair.draft='ngram3'") as e:
        ProfileCost(exp)
    assert CALIBRATE_CMD in str(e.value)


def test_cli_without_profile_exits_2_with_the_calibrate_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = run_cli("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                f"sim.profile_path={tmp_path / 'missing.json'}", "workload.num_prompts=1",
                "workload.max_new_tokens=4", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "python -m testbed backend=real +calibrate" in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_calibrate_flag_needs_backend_real() -> None:
    from testbed.app.preflight import normalize_args

    assert normalize_args(["backend=real", "+calibrate"]) == ["backend=real", "calibrate=true"]
    assert normalize_args(["+calibrate=false", "x=1"]) == ["calibrate=false", "x=1"]
    with pytest.raises(ConfigError, match="calibrate"):
        compose_exp("calibrate=true")


def test_calibration_smoothing_survives_one_outlier() -> None:
    from real.calibrate.fit import isotonic, smooth_table, theil_sen

    a, b = theil_sen([64, 128, 256, 512, 1024], [1.064, 1.128, 9.0, 1.512, 2.024])
    assert a == pytest.approx(1.0, abs=1e-9) and b == pytest.approx(1e-3, abs=1e-9)
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    raw = [[0.02, 0.03], [0.02, 0.5], [0.021, 0.031], [0.022, 0.032]]  # one spike at (128, k=2)
    smooth = smooth_table(raw, [64, 128, 256, 512])
    assert smooth[1][1] < 0.04
    assert all(r[1] >= r[0] for r in smooth)


def test_rescale_follows_the_calibrate_runs_round_times(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """profile_rescale: a machine running 2x slower than the profile (k=5) is predicted 2x slower;
    other k keep the profile's shape with the role's overall scale."""
    from testbed.recorder import RequestRecord, RunRecorder, RunResult
    from testbed.results import write_run

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make_profile()))
    base = ("pair=smollm2_135m+smollm2_exit10", "hardware=local", "schedule.gamma=4", "workload=humaneval")
    real = compose_exp("backend=real", *base, "workload.split=calibrate")
    plain = ProfileCost(compose_exp(*base, "sim.cost_model=profile", f"sim.profile_path={path}"))
    rec, seq_len = RunRecorder(), 100
    for r in range(8):  # 8 rounds, each keeps 1 of 4 guesses: the target verifies 5 tokens
        t_target = 2.0 * plain.forward("target", 5, seq_len - 1)
        t_draft = 3.0 * sum(plain.forward("draft", 1, seq_len + i - 1) for i in range(4))
        rec.round(request_id=0, round_idx=r, start_s=0.0, end_s=0.0, drafted=4, checked=2,
                  accepted=1, emitted=2, verified_tokens=5, draft_s=t_draft, target_s=t_target)
        seq_len += 2
    rec.request(RequestRecord(request_id=0, prompt_id="HumanEval/0", prompt_len=100, output_ids=[],
        generated=16, prefill_s=0.1, decode_s=1.0, rounds=8))
    write_run(tmp_path / "runs" / "0", real, RunResult(recorder=rec))
    exp = compose_exp(*base, "sim.cost_model=profile", f"sim.profile_path={path}", "acceptance=trace",
                      f"acceptance.trace_path={tmp_path / 'runs'}", "sim.profile_rescale=true",
                      "workload.split=holdout")
    scaled = ProfileCost(exp)
    assert scaled.scale_k[5] == pytest.approx(2.0, rel=1e-9)
    assert scaled.scale["target"] == pytest.approx(2.0, rel=1e-9)
    assert scaled.scale["draft"] == pytest.approx(3.0, rel=0.02)  # the first forward feeds 1 or 2
    assert scaled.forward("target", 5, 300) == pytest.approx(2.0 * plain.forward("target", 5, 300))
    assert scaled.decode_seconds(tmp_path / "runs" / "0")[0] == pytest.approx(
        sum(rec.rounds[i][9] + rec.rounds[i][10] for i in range(8)), rel=0.02)


def test_probe_drift_scales_every_time_by_the_bandwidth_ratio(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """sim.profile_drift=probe: a machine whose copy bandwidth is half the profile's is predicted
    2x slower for both models; a profile without a probe is refused, naming the setting."""
    import testbed.machine as machine

    prof = make_profile()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    base = ("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile",
            f"sim.profile_path={path}")
    with pytest.raises(ConfigError, match="sim.profile_drift.*no bandwidth probe"):
        ProfileCost(compose_exp(*base, "sim.profile_drift=probe"))
    path.write_text(json.dumps({**prof, "probe": {"gbps": 10.0}}))
    monkeypatch.setattr(machine, "_last", None)
    monkeypatch.setattr(machine, "bandwidth_probe_gbps", lambda **_: 5.0)
    plain = ProfileCost(compose_exp(*base))
    drifted = ProfileCost(compose_exp(*base, "sim.profile_drift=probe"))
    assert drifted.drift == pytest.approx(2.0)
    for role, k in (("target", 5), ("draft", 1)):
        assert drifted.forward(role, k, 200) == pytest.approx(2.0 * plain.forward(role, k, 200))
    with pytest.raises(ConfigError, match="profile_rescale"):
        validate(compose_exp(*base, "sim.profile_drift=probe", "sim.profile_rescale=true"))


def test_forward_drift_scales_each_model_by_its_own_probe(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """sim.profile_drift=forward: each model's times scale by its probe forward now over the
    same probe in the profile (target 1.5x slower, draft unchanged); an n-gram draft takes the
    target's factor; a profile without the probe is refused naming the setting and the fix."""
    import dataclasses

    import testbed.backends as backends

    prof = make_profile()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    now = {"smollm2_135m": 0.030, "smollm2_exit10": 0.004}
    real = backends.get("real")
    monkeypatch.setitem(backends.BACKENDS.entries, "real", dataclasses.replace(real, probe_forward=lambda exp: now))
    base = ("hardware=local", "sim.cost_model=profile", f"sim.profile_path={path}")
    exit10 = (*base, "pair=smollm2_135m+smollm2_exit10")
    with pytest.raises(ConfigError, match="sim.profile_drift.*no forward probe of smollm2_135m.*calibrate"):
        ProfileCost(compose_exp(*exit10, "sim.profile_drift=forward"))
    path.write_text(json.dumps({**prof, "probe": {"forward_s": {"smollm2_135m": 0.020, "smollm2_exit10": 0.004}}}))
    plain = ProfileCost(compose_exp(*exit10))
    drifted = ProfileCost(compose_exp(*exit10, "sim.profile_drift=forward"))
    assert drifted.drift_by_role == pytest.approx({"target": 1.5, "draft": 1.0})
    assert drifted.forward("target", 5, 200) == pytest.approx(1.5 * plain.forward("target", 5, 200))
    assert drifted.forward("draft", 1, 200) == pytest.approx(plain.forward("draft", 1, 200))
    ngram = (*base, "pair=smollm2_135m+ngram3")
    drifted = ProfileCost(compose_exp(*ngram, "sim.profile_drift=forward"))
    assert drifted.drift_by_role == pytest.approx({"target": 1.5, "draft": 1.5})
    with pytest.raises(ConfigError, match="sim.profile_drift.*cost_model=profile"):
        validate(compose_exp("sim.profile_drift=forward", "sim.cost_model=roofline"))


def test_the_forward_probe_times_each_function_interleaved() -> None:
    """real/calibrate/probe_forward.time_functions: the median per function, every function called in
    each pass (a burst of load hits all alike)."""
    import time

    from real.calibrate.probe_forward import time_functions

    calls: list[str] = []

    def fn(name: str, seconds: float):  # type: ignore[no-untyped-def]
        def call() -> None:
            calls.append(name)
            time.sleep(seconds)
        return call

    out = time_functions({"slow": fn("slow", 0.004), "fast": fn("fast", 0.0)}, repeats=5, warmup=1)
    assert calls == ["slow", "fast"] * 6
    assert out["slow"] >= 0.004 > out["fast"]


def test_a_tree_expansion_is_charged_its_measured_overhead_beyond_the_forward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """real/calibrate/tree.py's "tree_expand" table: the serial tree's draft phase grows by the
    table's seconds once per expansion (interpolated by leaves), and not at all without it."""
    from sim.runtime.engine import run

    prof = make_profile()
    prof["models"]["smollm2_draft"] = {"kind": "transformer", "role": "draft", "layers": 3,
                                       "forward": {"greedy": {"k": K, "context": CTX, "seconds": [r[:4] for r in TARGET]}}}
    plain_path, tree_path = tmp_path / "plain.json", tmp_path / "tree.json"
    plain_path.write_text(json.dumps(prof))
    prof["models"]["smollm2_draft"]["tree_expand"] = {"greedy": {"leaves": [1, 16], "seconds": [0.001, 0.001]}}
    tree_path.write_text(json.dumps(prof))
    base = ("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile", "schedule=sync",
            "schedule.tree=true", "schedule.tree_width=4", "schedule.tree_budget=8", "schedule.gamma=3",
            "acceptance=synthetic", "workload.num_prompts=2", "workload.max_new_tokens=24")
    plain = run(compose_exp(*base, f"sim.profile_path={plain_path}")).recorder.frames()[0]
    tree = run(compose_exp(*base, f"sim.profile_path={tree_path}")).recorder.frames()[0]
    assert list(plain["accepted"]) == list(tree["accepted"])  # timing does not change the tokens
    expansions = (tree["draft_s"] - plain["draft_s"]) / 0.001
    assert (expansions.round() - expansions).abs().max() < 1e-6  # whole expansions
    assert expansions.min() >= 3  # d = γ expansions per round at least (then filled to bs)
    prof["models"]["smollm2_draft"]["tree_expand"]["greedy"]["seconds"] = [0.001, 0.016]
    tree_path.write_text(json.dumps(prof))
    cost = ProfileCost(compose_exp(*base, f"sim.profile_path={tree_path}"))
    assert cost.tree_expand_extra(4) == pytest.approx(0.004)  # interpolated by leaves


def test_bandwidth_probe_reads_a_plausible_speed() -> None:
    from testbed.machine import bandwidth_probe_gbps, drift_factor

    gbps = bandwidth_probe_gbps(mb=16, repeats=3)
    assert 0.1 < gbps < 1000  # a copy of 16 MB: any real machine lands here, a unit slip does not
    assert drift_factor(10.0, 5.0) == 2.0
    with pytest.raises(ValueError):
        drift_factor(10.0, 0.0)


def test_validation_shows_the_standalone_prediction_beside_the_rescaled_one(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The trace run's rounds took 2x the profile's times: the standalone prediction (probe drift
    1.0) keeps the profile's speed, the rescaled one is half as fast — both in the report's frame."""
    import testbed.machine as machine
    from sim.runtime.engine import run as simulate
    from testbed.recorder import RequestRecord, RunRecorder, RunResult
    from testbed.report.sections_validate import rescaled_frame, validation_frame
    from testbed.results import find_runs, write_run

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**make_profile(), "probe": {"gbps": 8.0}}))
    monkeypatch.setattr(machine, "_last", None)
    monkeypatch.setattr(machine, "bandwidth_probe_gbps", lambda **_: 8.0)
    base = ("pair=smollm2_135m+smollm2_exit10", "hardware=local", "schedule.gamma=4", "workload=humaneval",
            "workload.num_prompts=1", "workload.max_new_tokens=16")
    sweep = tmp_path / "sweep"
    plain = ProfileCost(compose_exp(*base, "sim.cost_model=profile", f"sim.profile_path={path}"))
    for name, split in (("0", "trace"), ("1", "test")):  # real runs: 2x the profile's round times
        rec, seq_len = RunRecorder(), 100
        for r in range(8):
            t_target = 2.0 * plain.forward("target", 5, seq_len - 1)
            t_draft = 2.0 * sum(plain.forward("draft", 1, seq_len + i - 1) for i in range(4))
            rec.round(request_id=0, round_idx=r, start_s=0.0, end_s=0.0, drafted=4, checked=2,
                      accepted=1, emitted=2, verified_tokens=5, draft_s=t_draft, target_s=t_target)
            seq_len += 2
        rec.request(RequestRecord(request_id=0, prompt_id="HumanEval/0", prompt_len=100, output_ids=[],
            generated=16, prefill_s=0.1, decode_s=1.0, rounds=8))
        write_run(sweep / name, compose_exp("backend=real", *base, f"workload.split={split}"),
                  RunResult(recorder=rec))
    pred = validate(compose_exp(*base, "sim.cost_model=profile", f"sim.profile_path={path}", "acceptance=trace",
                                f"acceptance.trace_path={sweep}", "sim.profile_drift=probe", "workload.split=test"))
    write_run(sweep / "2", pred, simulate(pred))
    runs = find_runs([sweep])
    both = rescaled_frame(runs, validation_frame(runs))
    assert len(both) == 1
    row = both.iloc[0]
    assert row["drift_factor"] == pytest.approx(1.0)
    assert row["rescaled"] == pytest.approx(row["standalone"] / 2.0, rel=0.05)
    assert row["rescaled_error_pct"] == pytest.approx(100 * (row["rescaled"] / row["measured"] - 1))


def test_an_ngram_tree_expansion_is_charged_whole_from_its_own_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The n-gram draft's tree expansions (lookups, vocabulary-wide distributions, selection)
    were charged as the chain's lookup (~0.05 ms) where real async runs measured 0.2-0.9 ms:
    with a "tree_expand" table an expansion costs that table, and the lookup is not added."""
    from real.calibrate.tree import add_ngram_tree_tables
    from testbed.compose import compose_experiment

    models = make_profile()["models"]
    draft = compose_experiment(["pair=smollm2_135m+ngram3"]).pair.draft
    add_ngram_tree_tables(models, [draft], vocab=512, log=lambda _: None)
    for key in ("tree_expand", "tree_rounds"):
        assert set(models["ngram3"][key]) == {"greedy", "sample"}
    table = models["ngram3"]["tree_expand"]["greedy"]
    assert table["leaves"] and all(s > 0 for s in table["seconds"])
    table["seconds"] = [0.001 * n for n in table["leaves"]]  # known values to read back
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**make_profile(), "models": models}))
    cost = ProfileCost(compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                                   f"sim.profile_path={path}", "schedule=async", "sampling.temperature=0.0"))
    n = table["leaves"][-1]
    assert cost.tree_forward("draft", n, 100) == 0.0  # the lookups are inside the expansion's time
    assert cost.tree_expand_extra(n) == pytest.approx(0.001 * n)
    chain = ProfileCost(compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                                    f"sim.profile_path={path}", "schedule.gamma=4", "sampling.temperature=0.0"))
    assert chain.forward("draft", 1, 100) > 0.0  # the chain still pays its lookup


BATCH_K, BATCHES = [1, 2, 4], [1, 2, 4, 8]
BATCH = [[0.02 + 0.004 * b * k ** 1.2 for k in BATCH_K] for b in BATCHES]  # [batch][k], at context 256


def test_a_batched_forward_reads_the_batched_table() -> None:
    """Under load the profile's batched table (real/calibrate/batch.py) times a forward over
    several requests: interpolated at the mean tokens per request, each request's attention beyond
    the table's context from the one-request table, Algorithm 1 per request; without the table
    (or for one request) what it did before."""
    prof = make_profile()
    plain = ProfileCost(compose_exp("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile"),
                        profile=prof)
    additive = plain.batch_forward("target", [(2, 256), (2, 256)])
    prof["models"]["smollm2_135m"]["batch"] = {"greedy": {"k": BATCH_K, "batch": BATCHES, "context": 256,
                                                         "seconds": BATCH}}
    c = ProfileCost(compose_exp("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile"),
                    profile=prof)
    accept2 = 2e-4
    assert c.batch_forward("target", [(2, 256), (2, 256)]) == pytest.approx(BATCH[1][1] + 2 * accept2, rel=1e-12)
    assert c.batch_forward("target", [(2, 256), (2, 256)]) != pytest.approx(additive)
    # 8 requests of 1 and 4 tokens (mean 2.5): between the table's k = 2 and 4 at B = 8
    mixed = c.batch_forward("target", [(1, 256)] * 4 + [(4, 256)] * 4)
    assert BATCH[3][1] < mixed - 4 * (1e-4 + 4e-4) < BATCH[3][2]
    # longer contexts add each request's own attention growth
    far = c.batch_forward("target", [(2, 1024), (2, 256)])
    growth = plain.forward("target", 2, 1024) - plain.forward("target", 2, 256)
    assert far == pytest.approx(BATCH[1][1] + 2 * accept2 + growth, rel=1e-9)
    assert c.batch_forward("target", [(2, 300)]) == pytest.approx(c.forward("target", 2, 300))  # one request
