"""`acceptance=trace`: replaying a real run's recorded rounds in the simulator."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pytest

from sim.oracle.trace import RequestTrace, TraceSequence, select_trace_runs
from sim.runtime.engine import run as sim_run
from testbed.config import ConfigError
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import build_summary, write_run
from tests.conftest import compose_exp

N_TOKENS = 60


def recorded_rounds(seed: int, gamma: int, ngram: bool = False) -> list[tuple[int, int, int]]:
    """(drafted, accepted, emitted) rounds of one request that emit exactly N_TOKENS tokens."""
    rng = random.Random(seed)
    out, generated = [], 0
    while generated < N_TOKENS:
        d = rng.choice([0, 1, 2, gamma, gamma]) if ngram else gamma
        n = rng.randint(0, d)
        e = min(n + 1, N_TOKENS - generated)
        out.append((d, n, e))
        generated += e
    return out


def write_trace_run(path: Path, gamma: int, split: str = "calibrate", requests: int = 2,
                    ngram: bool = False, temperature: float = 0.0, load: tuple[str, ...] = (),
                    empty_features: bool = False) -> list[list[tuple[int, int, int]]]:
    exp = compose_exp("backend=real", "pair=smollm2_135m+ngram3", f"schedule.gamma={gamma}",
                      f"workload.split={split}",
                      f"workload.max_new_tokens={N_TOKENS}", f"sampling.temperature={temperature}", *load)
    rec = RunRecorder()
    per_request = []
    for rid in range(requests):
        rounds = recorded_rounds(100 * rid + gamma, gamma, ngram)
        t = 0.0
        for i, (d, n, e) in enumerate(rounds):
            rec.round(request_id=rid, round_idx=i, start_s=t, end_s=t + 0.01, drafted=d,
                      checked=n + (n < d), accepted=n, emitted=e, verified_tokens=d + 1,
                      draft_s=0.001, target_s=0.009)
            if empty_features:  # a column of rows without features (a run that did not record them)
                rec.extra_round_columns.setdefault("draft_features", []).append([])
            t += 0.01
        rec.request(RequestRecord(request_id=rid, prompt_id=f"p{rid}", prompt_len=100, output_ids=[],
            generated=N_TOKENS, prefill_s=0.1, decode_s=t, rounds=len(rounds)))
        per_request.append(rounds)
    write_run(path, exp, RunResult(recorder=rec))
    return per_request


def sim_exp(trace: Path, gamma: int, requests: int = 2, *extra: str):  # type: ignore[no-untyped-def]
    return compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=analytic",
                       "workload=synthetic", f"workload.num_prompts={requests}",
                       f"workload.max_new_tokens={N_TOKENS}", "workload.prompt_len=64",
                       "acceptance=trace", f"acceptance.trace_path={trace}", f"schedule.gamma={gamma}",
                       *extra)


@pytest.mark.parametrize("ngram", [False, True])
def test_same_gamma_reproduces_the_recorded_rounds(tmp_path: Path, ngram: bool) -> None:
    recorded = write_trace_run(tmp_path / "real", gamma=4, ngram=ngram)
    rounds, _, _ = sim_run(sim_exp(tmp_path / "real", 4)).recorder.frames()
    for rid, rec in enumerate(recorded):
        got = rounds[rounds["request_id"] == rid]
        assert list(zip(got["drafted"], got["accepted"], got["emitted"])) == rec
    want = pd.Series([n for rec in recorded for _, n, _ in rec]).value_counts().sort_index()
    assert rounds["accepted"].value_counts().sort_index().tolist() == want.tolist()
    # a target forward verifies only what was proposed (n-gram drafts propose fewer than γ)
    assert (rounds["verified_tokens"] == rounds["drafted"] + 1).all()


def test_the_match_stream_drives_another_gamma() -> None:
    full = RequestTrace([(4, 4)] * 10, gamma=4)  # every guess matched at γ=4
    seq = TraceSequence(full, random.Random(0))
    assert [seq.chain_round(2).accepted for _ in range(8)] == [2] * 8
    alternating = RequestTrace([(4, 1)] * 10, gamma=4)  # stream 1,0,1,0,...
    seq = TraceSequence(alternating, random.Random(0))
    assert [seq.chain_round(6).accepted for _ in range(8)] == [1] * 8
    seq = TraceSequence(alternating, random.Random(0))
    assert [seq.chain_round(1).accepted for _ in range(4)] == [1, 1, 1, 1]


def test_a_directory_of_runs_prefers_calibrate_runs_and_the_same_gamma(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "a", gamma=4, split="holdout")
    write_trace_run(tmp_path / "b", gamma=2, split="calibrate")
    write_trace_run(tmp_path / "c", gamma=4, split="calibrate")
    write_trace_run(tmp_path / "d", gamma=4, split="calibrate", temperature=1.0)
    exp = sim_exp(tmp_path, 4, 2, "workload=humaneval", "workload.split=holdout")
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["c"]
    exp.schedule.gamma = 6  # no γ=6 trace: any calibrate run of the same key drives it
    assert sorted(d.name for d, _ in select_trace_runs(tmp_path, exp)) == ["b", "c"]


def test_a_prediction_replays_runs_of_its_own_load(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "alone", gamma=4)
    write_trace_run(tmp_path / "two", gamma=4, load=("workload.concurrency=2",))
    exp = sim_exp(tmp_path, 4, 2, "workload=humaneval", "workload.split=holdout")
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["alone"]
    exp = sim_exp(tmp_path, 4, 2, "workload=humaneval", "workload.split=holdout", "workload.concurrency=2")
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["two"]


def test_a_per_token_policy_refuses_a_trace_whose_features_are_all_empty(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "real", gamma=4, empty_features=True)
    with pytest.raises(ConfigError, match="per-token draft features"):
        sim_run(sim_exp(tmp_path / "real", 4, 2, "lookahead=confidence"))


def test_a_test_split_prediction_replays_trace_runs_never_its_own(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "cal", gamma=4, split="calibrate")
    write_trace_run(tmp_path / "own", gamma=4, split="test")
    exp = sim_exp(tmp_path, 4, 2, "workload=humaneval", "workload.split=test")
    # no `trace` run yet: anything but the predicted split itself
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["cal"]
    write_trace_run(tmp_path / "tr", gamma=4, split="trace")
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["tr"]


def test_missing_or_empty_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="acceptance.trace_path"):
        sim_run(sim_exp(tmp_path / "nowhere", 4))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="none found"):
        sim_run(sim_exp(tmp_path / "empty", 4, 2, "workload=humaneval"))
    with pytest.raises(ConfigError, match="trace_path"):
        sim_run(compose_exp("acceptance=trace", "workload.num_prompts=1"))


def test_an_ar_baseline_replays_from_a_directory_holding_only_async_runs(tmp_path: Path) -> None:
    # `+sweep=gpu_split backend=real`: the async split's prediction runs before any sync run
    # exists, and its `ar` baseline must still find a recorded run (ar replays nothing)
    exp = compose_exp("backend=real", "pair=smollm2_135m+ngram3", "schedule=async", "workload.split=calibrate",
                      f"workload.max_new_tokens={N_TOKENS}")
    rec = RunRecorder()
    rec.round(request_id=0, round_idx=0, start_s=0.0, end_s=0.01, drafted=4, checked=2, accepted=1,
              emitted=2, verified_tokens=4, draft_s=0.001, target_s=0.009)
    rec.request(RequestRecord(request_id=0, prompt_id="p0", prompt_len=100, output_ids=[], generated=2,
        prefill_s=0.1, decode_s=0.01, rounds=1))
    write_run(tmp_path / "async", exp, RunResult(recorder=rec))
    run = tmp_path / "async"
    assert [d.name for d, _ in select_trace_runs(run, sim_exp(run, 4, 2, "schedule=ar"))] == ["async"]
    assert select_trace_runs(run, sim_exp(run, 4)) == []  # a sync chain replays a chain


def test_a_wan_prediction_replays_its_own_dsd_run_and_its_ar_baseline_too(tmp_path: Path) -> None:
    # `+sweep=wan backend=real`: the predict role replays the rounds the measure role recorded on
    # the same (`test`) prompts — DSD's adaptive rule decided them — and so does its `ar` baseline
    gamma = 4
    exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_draft", "schedule=decentralized",
                      "placement.nodes=2", f"schedule.gamma={gamma}", "workload=humaneval",
                      "workload.split=test", f"workload.max_new_tokens={N_TOKENS}")
    rec = RunRecorder()
    rounds = recorded_rounds(7, gamma)
    t = 0.0
    for i, (d, n, e) in enumerate(rounds):
        rec.round(request_id=0, round_idx=i, start_s=t, end_s=t + 0.01, drafted=d, checked=n + (n < d),
                  accepted=n, emitted=e, verified_tokens=d + 1, draft_s=0.001, target_s=0.009)
        t += 0.01
    rec.request(RequestRecord(request_id=0, prompt_id="p0", prompt_len=100, output_ids=[],
        generated=N_TOKENS, prefill_s=0.1, decode_s=t, rounds=len(rounds)))
    write_run(tmp_path / "dsd", exp, RunResult(recorder=rec))
    pred = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "schedule=decentralized",
                       "placement.nodes=2", f"schedule.gamma={gamma}", "workload=humaneval",
                       "workload.split=test", "workload.num_prompts=1", f"workload.max_new_tokens={N_TOKENS}",
                       "acceptance=trace", f"acceptance.trace_path={tmp_path}")
    assert [d.name for d, _ in select_trace_runs(tmp_path, pred)] == ["dsd"]
    baseline = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "schedule=ar",
                           "workload=humaneval", "workload.split=test", "acceptance=trace",
                           f"acceptance.trace_path={tmp_path}")
    assert [d.name for d, _ in select_trace_runs(tmp_path, baseline)] == ["dsd"]
    summary = build_summary(pred, sim_run(pred))
    recorded = sum(n for _, n, _ in rounds) / len(rounds)
    assert summary["mean_accepted_len"] == pytest.approx(recorded + 1)  # the recorded rounds, replayed


def test_an_ar_baseline_of_a_feature_reading_policy_needs_no_features(tmp_path: Path) -> None:
    # a confidence or DISCO prediction's `ar` baseline keeps the policy setting but drafts
    # nothing: it must not demand per-token features (the validate DISCO prediction failed so)
    from sim.oracle.trace import load_trace
    from testbed.config import ConfigError

    run = tmp_path / "run"
    write_trace_run(run, 2)
    with pytest.raises(ConfigError, match="per-token draft features"):
        load_trace(sim_exp(run, 2, 2, "lookahead=confidence"))
    baseline = sim_exp(run, 2, 2, "lookahead=confidence")
    baseline.schedule.name = "ar"  # as the prediction builds its baseline: the policy stays
    assert len(load_trace(baseline)) == 2


def test_a_corrupt_trace_names_the_whole_reason_in_one_line(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "run", 4)
    (tmp_path / "run" / "rounds.parquet").write_bytes(b"PA")  # 2 bytes: not a parquet file
    with pytest.raises(ConfigError) as e:
        sim_run(sim_exp(tmp_path / "run", 4))
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("); re-record it")
    reason = msg.split("not a readable parquet file (", 1)[1][:-len("); re-record it")]
    import pyarrow.parquet as pq

    with pytest.raises(Exception) as direct:
        pq.read_table(tmp_path / "run" / "rounds.parquet")
    assert reason == " ".join(str(direct.value).split())  # all of it, not cut mid-word


def test_the_record_command_a_missing_trace_suggests_records_the_pair_asked_for(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        sim_run(compose_exp("acceptance=trace", f"acceptance.trace_path={tmp_path / 'empty'}",
                            "pair=llama3_70b+llama3_2_3b", "workload=synthetic", "workload.num_prompts=1"))
    asked, suggested = str(e.value).split("(none found)")
    assert "pair=llama3_70b+llama3_2_3b workload=synthetic" in asked
    assert "backend=real schedule=sync pair=llama3_70b+llama3_2_3b workload=synthetic " in suggested
