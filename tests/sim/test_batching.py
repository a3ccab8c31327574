"""sim/runtime/batching.py: arrivals, admission and continuous batching in the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from sim.runtime.engine import run
from sim.runtime.simulate import make_requests, simulate
from testbed.arrivals import poisson_times
from testbed.config import ConfigError
from testbed.results import build_summary
from tests.conftest import compose_exp, run_cli

SMALL = ("pair=smollm2_135m+smollm2_draft", "hardware=local", "workload.num_prompts=6", "workload.max_new_tokens=48")
LOAD_COLUMNS = ["arrival_s", "queue_s", "first_token_s", "finish_s"]


@pytest.mark.parametrize("overrides", [
    ("schedule=ar",), ("schedule=sync",), ("schedule=sync", "lookahead=heuristic"),
    ("schedule=sync", "acceptance=synthetic", "sampling.temperature=1"),
    ("schedule=sync", "schedule.tree=true"), ("schedule=sync", "schedule.tree=true", "acceptance=synthetic"),
    ("schedule=async",), ("schedule=async", "acceptance=synthetic", "sampling.temperature=1"),
])
def test_one_closed_loop_client_reproduces_one_request_at_a_time_exactly(overrides: tuple[str, ...]) -> None:
    exp = compose_exp(*overrides, *SMALL)
    requests = make_requests(exp)
    frames = []
    for batched in (False, True):
        extra: dict = {}
        rounds, reqs, _ = simulate(exp, requests, seed=exp.seed, batched=batched, extra=extra).frames()
        frames.append((rounds, reqs.drop(columns=LOAD_COLUMNS), extra))
    (r0, q0, e0), (r1, q1, e1) = frames
    pd.testing.assert_frame_equal(r0, r1)
    pd.testing.assert_frame_equal(q0, q1)
    assert e0 == e1


def served(*overrides: str) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    exp = compose_exp(*SMALL, *overrides)
    result = run(exp)
    _, requests, timeline = result.recorder.frames()
    return build_summary(exp, result), requests, timeline


def test_admission_keeps_the_kv_budget_and_queues_the_rest() -> None:
    budget = 2 * (256 + 48 + 5) + 10  # two requests' reservations fit, a third does not
    _, q, tl = served("schedule=sync", "workload.concurrency=4", f"serving.kv_budget_tokens={budget}")
    need = q["prompt_len"] + 48 + 5
    admit = q["arrival_s"] + q["queue_s"]
    for t in sorted(admit):  # at every admission, the admitted and unfinished requests' reservations
        live = (admit <= t) & (q["finish_s"] > t)
        assert need[live].sum() <= budget
    assert tl.loc[tl["kind"] == "verify", "batch"].max() == 2
    assert (q["queue_s"] > 0).sum() >= 2


def test_max_batch_bounds_every_round() -> None:
    _, q, tl = served("schedule=ar", "workload.concurrency=5", "serving.max_batch=3")
    batches = tl.loc[tl["kind"] == "decode", "batch"]
    assert batches.max() == 3 and batches.min() >= 1
    assert len(q) == 6 and (q["generated"] == 48).all()


def test_batching_amortizes_the_weights_of_a_memory_bound_target() -> None:
    one, _, _ = served("schedule=ar", "workload.concurrency=1", "workload.arrival=poisson", "workload.rate=0.001")
    four, _, _ = served("schedule=ar", "workload.concurrency=4")
    assert four["mean_batch"] > 3
    assert four["throughput_tok_s"] > 2.5 * one["throughput_tok_s"]


def test_outputs_under_batching_equal_each_requests_ar_output() -> None:
    # temperature 0, an oracle with token ids: batched sync and batched ar give every request
    # the output it gets served alone
    alone = {r.request_id: list(r.output_ids) for r in served("schedule=ar", "acceptance=synthetic")[1].itertuples()}
    for schedule in ("schedule=ar", "schedule=sync", "schedule.tree=true", "schedule=async"):
        _, q, _ = served(schedule, "acceptance=synthetic", "workload.concurrency=3")
        assert {r.request_id: list(r.output_ids) for r in q.itertuples()} == alone


def test_the_batch_policy_drafts_the_gamma_of_each_rounds_batch_size() -> None:
    """lookahead=batch: γ by the requests in the round — 4 alone, 2 from two on, none from four —
    with the outputs `ar` gives (temperature 0, token ids)."""
    alone = {r.request_id: list(r.output_ids) for r in served("schedule=ar", "acceptance=synthetic")[1].itertuples()}
    exp = compose_exp(*SMALL, "schedule=sync", "lookahead=batch", "lookahead.by_batch=1:4 2:2 4:0",
                      "acceptance=synthetic", "workload.concurrency=4")
    rounds, q, _ = run(exp).recorder.frames()
    assert {r.request_id: list(r.output_ids) for r in q.itertuples()} == alone
    batch = rounds.groupby("start_s").request_id.transform("size")  # a batched round's requests share its start
    want = batch.map(lambda b: 0 if b >= 4 else 2 if b >= 2 else 4)
    assert (rounds.drafted == want).all()
    assert set(batch) >= {4, 2, 1}  # full rounds without speculation, and the tail with it


def test_poisson_arrivals_follow_the_seed() -> None:
    exp = compose_exp(*SMALL, "workload.arrival=poisson", "workload.rate=4")
    _, q, _ = served("workload.arrival=poisson", "workload.rate=4")
    assert q.sort_values("request_id")["arrival_s"].tolist() == pytest.approx(poisson_times(6, 4.0, exp.seed))
    assert poisson_times(6, 4.0, 1) != poisson_times(6, 4.0, 0)


def test_load_metrics_are_ordered_and_the_slo_bounds_goodput() -> None:
    free, q, _ = served("schedule=sync", "workload.concurrency=3")
    tight, _, _ = served("schedule=sync", "workload.concurrency=3", "serving.slo_ttft_ms=1")
    for m in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert free[f"{m}_p50"] <= free[f"{m}_p90"] <= free[f"{m}_p99"]
    assert free["ttft_ms_p99"] < free["e2e_ms_p99"]
    assert free["slo_attainment"] == 1.0 and tight["slo_attainment"] == 0.0
    assert free["goodput_req_s"] > 0 and tight["goodput_req_s"] == 0
    assert free["load_speedup"] == pytest.approx(free["throughput_tok_s"] / free["ar_throughput_tok_s"])
    assert free["tpot_speedup"] > 1  # the bundled pair's sync beats ar per token at 3 clients
    assert free["tokens_per_s"] > 0 and "ttft_ms_p50" not in served("schedule=sync")[0]


def test_a_trace_sets_arrivals_and_lengths(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    pd.DataFrame({"arrival_s": [0.0, 0.5, 0.5, 2.0], "prompt_tokens": [100, 40, 300, 20],
                  "output_tokens": [10, 20, 5, 8]}).to_csv(path, index=False)
    _, q, _ = served("schedule=sync", "workload.arrival=trace", f"workload.trace_path={path}")
    q = q.sort_values("request_id")
    assert q["arrival_s"].tolist() == [0.0, 0.5, 0.5, 2.0]
    assert q["prompt_len"].tolist() == [100, 40, 300, 20] and q["generated"].tolist() == [10, 20, 5, 8]
    assert (q["first_token_s"] >= q["arrival_s"]).all()


@pytest.mark.parametrize(("rows", "says"), [
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n-1,10,5\n", "row 2"),
    ("arrival_s,prompt_tokens,output_tokens\n0.5,10,5\n0.2,10,5\n", "sort the trace"),
    ("arrival_s,prompt_tokens\n0,10\n", "no column output_tokens"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,2.5,5\n", "prompt_tokens must be a whole number"),
])
def test_a_bad_trace_is_refused_with_one_line_naming_the_row(rows: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(rows)
    out = tmp_path / "run"
    p = run_cli("workload.arrival=trace", f"workload.trace_path={path}", f"hydra.run.dir={out}")
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert not (out / "summary.json").exists()


def test_a_request_larger_than_the_kv_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="serving.kv_budget_tokens"):
        run(compose_exp(*SMALL, "workload.concurrency=2", "serving.kv_budget_tokens=200"))
    out = tmp_path / "run"
    p = run_cli(*SMALL, "workload.concurrency=2", "serving.kv_budget_tokens=200", f"hydra.run.dir={out}")
    assert p.returncode == 2 and "needs its prompt" in p.stderr
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize(("overrides", "says"), [
    (("backend=real", "schedule=decentralized", "placement.nodes=1", "workload.concurrency=2"),
     "a one-node pipeline serves one request at a time"),
    (("backend=real", "schedule=async", "pair=smollm2_135m+ngram3", "workload.concurrency=2"),
     "transformer or eagle under load (workload.arrival=closed with workload.concurrency=2) with async's token trees"),
    (("backend=real", "workload.concurrency=2", "schedule=async", "placement.target_gpus=2",
      "hardware.gpus_per_node=3"), "tensor parallelism serves the batched rounds of `ar`, the sync chain and the serial tree"),
    (("serving.max_batch=4",), "has no effect"),
    (("workload.concurrency=2", "workload.rate=3"), "workload.arrival=poisson"),
])
def test_what_cannot_serve_load_says_so(overrides: tuple[str, ...], says: str, tmp_path: Path) -> None:
    p = run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_the_summary_file_holds_the_load_metrics(tmp_path: Path) -> None:
    p = run_cli(*SMALL, "workload.concurrency=2", f"hydra.run.dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert "under load: 2 clients" in p.stdout and "TTFT ms" in p.stdout and "goodput" in p.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean_batch"] > 1 and summary["throughput_tok_s"] > 0
    assert set(pd.read_parquet(tmp_path / "timeline.parquet").columns) >= {"batch"}


PIPELINE = ("schedule=decentralized", "hardware=a800_nodes", "network=wan", "pair=llama3_8b+llama3_2_1b",
            "placement.nodes=4", "acceptance=synthetic", "workload.num_prompts=6", "workload.max_new_tokens=40")


@pytest.mark.parametrize("schedule", ["schedule=decentralized", "schedule=ar"])
def test_one_client_of_a_pipeline_reproduces_one_request_at_a_time_exactly(schedule: str) -> None:
    exp = compose_exp(*PIPELINE, schedule)
    requests = make_requests(exp)
    frames = [simulate(exp, requests, seed=exp.seed, batched=b).frames() for b in (False, True)]
    pd.testing.assert_frame_equal(frames[0][0], frames[1][0])
    pd.testing.assert_frame_equal(frames[0][1].drop(columns=LOAD_COLUMNS), frames[1][1].drop(columns=LOAD_COLUMNS))


def test_a_pipeline_serves_requests_in_flight_at_once_and_keeps_each_stage_to_one() -> None:
    one = build_summary(exp1 := compose_exp(*PIPELINE, "workload.arrival=poisson", "workload.rate=0.001"), run(exp1))
    exp = compose_exp(*PIPELINE, "workload.concurrency=4")
    result = run(exp)
    four = build_summary(exp, result)
    _, q, tl = result.recorder.frames()
    # the links' 2 x 4 x 20 ms per round leave the stages idle: four requests in flight use them
    assert four["throughput_tok_s"] > 2.5 * one["throughput_tok_s"]
    alone = {r.request_id: list(r.output_ids) for r in run(compose_exp(*PIPELINE)).recorder.frames()[1].itertuples()}
    assert {r.request_id: list(r.output_ids) for r in q.itertuples()} == alone
    assert (q["first_token_s"] > q["arrival_s"]).all() and (q["finish_s"] >= q["first_token_s"]).all()
    for stage in ("stage0", "stage1", "stage2", "stage3"):  # a stage's forwards never overlap
        spans = tl[tl["resource"] == stage].sort_values("start_s")
        assert (spans["start_s"].to_numpy()[1:] >= spans["end_s"].to_numpy()[:-1] - 1e-12).all()
    on_node0 = tl[tl["resource"].isin(["stage0", "draft"])].sort_values("start_s")  # the draft shares node 0
    assert (on_node0["start_s"].to_numpy()[1:] >= on_node0["end_s"].to_numpy()[:-1] - 1e-12).all()
    assert four["load_speedup"] == pytest.approx(four["throughput_tok_s"] / four["ar_throughput_tok_s"])
    assert four["mean_batch"] == 1.0  # the stages' forwards, one window each
    # four clients keep four in flight until the last of the six requests thin out; arrivals
    # hours apart never overlap (and leave the pipeline idle in between)
    assert 2.5 < four["mean_in_flight"] <= 4.0 and 0 < one["mean_in_flight"] < 1.0


def test_async_under_load_batches_both_groups() -> None:
    s, q, tl = served("schedule=async", "workload.concurrency=3")
    verify = tl[(tl["resource"] == "target") & (tl["kind"] == "verify")]
    expand = tl[(tl["resource"] == "draft") & (tl["kind"] == "expand")]
    assert verify["batch"].max() == 3 and expand["batch"].max() == 3
    # the draft group expands while the target group verifies
    overlap = [((expand["start_s"] < v.end_s) & (expand["end_s"] > v.start_s)).any() for v in verify.itertuples()]
    assert sum(overlap) > len(verify) / 2
    assert (q["generated"] == 48).all() and s["mean_batch"] > 2
