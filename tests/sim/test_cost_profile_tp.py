"""The `profile` cost model at TP > 1 and for tree-shaped forwards (synthetic profile tables,
nothing measured): the ratio lookup, the group's degree from the placement, schema-1 profiles;
and `acceptance=trace` replaying a recorded serial-tree run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sim.cost.profile import ProfileCost, tp_degrees
from sim.runtime.engine import run as sim_run
from testbed.config import ConfigError
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.sim.test_cost_profile import CTX, TARGET, K, make_profile

TP_K = [1, 4, 16]
TP_CTX = [64, 512]


def tp_table(scale: float, slope: float) -> dict:
    return {"k": TP_K, "context": TP_CTX,
            "seconds": [[scale * (0.01 + slope * k + 1e-5 * c) for k in TP_K] for c in TP_CTX]}


TABLES = {"1": {"chain": tp_table(1.0, 0.001), "tree": tp_table(1.0, 0.002)},
          "2": {"chain": tp_table(0.7, 0.001), "tree": tp_table(0.8, 0.002)}}


def at(table: dict, k: int, c: int) -> float:
    return table["seconds"][TP_CTX.index(c)][TP_K.index(k)]


def profile_with_tp() -> dict:
    prof = make_profile()
    prof["models"]["smollm2_135m"]["tp"] = TABLES
    prof["models"]["smollm2_draft"] = {**prof["models"]["smollm2_exit10"], "kind": "transformer",
                                       "tp": TABLES}
    # every draft available here is in a current profile: the shipped eagle head too, with its
    # tree tables (real/calibrate/tree.add_eagle_tree_tables)
    prof["models"]["smollm2_eagle"] = {**prof["models"]["smollm2_exit10"], "kind": "eagle", "tp": TABLES,
                                       "tree_expand": {"greedy": {"leaves": [1, 16], "seconds": [0.001, 0.002]}},
                                       "tree_rounds": {"greedy": {"leaves": [1], "select_s": [0.0], "advance_s": [0.0]}}}
    for name in ("smollm2_135m", "smollm2_draft", "smollm2_eagle"):  # batched forwards (real/calibrate/batch.py)
        prof["models"][name]["batch"] = BATCH_TABLES
    return prof


# B requests x k tokens at 128 cached tokens: the weights once, a share per row and request
BATCH_TABLES = {"greedy": {"k": [1, 2], "batch": [1, 2], "context": 128,
                           "seconds": [[0.020, 0.021], [0.021, 0.023]]}}


def tree_cost(tp: int, profile: dict) -> ProfileCost:
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                      "schedule=sync", "schedule.tree=true", f"placement.target_gpus={tp}",
                      f"placement.draft_gpus={tp}")
    return ProfileCost(exp, profile=profile)


def main_target(k: int, c: int) -> float:
    return TARGET[CTX.index(c)][K.index(k)]


ACCEPT = dict(zip(K, [1e-4, 2e-4, 3e-4, 4e-4]))


def test_tp1_chain_is_the_main_table_and_tree_its_measured_ratio() -> None:
    c = tree_cost(1, profile_with_tp())
    for k, ctx in ((1, 64), (4, 256), (4, 1024)):
        assert c.forward("target", k, ctx) == pytest.approx(main_target(k, ctx) + ACCEPT[k], rel=1e-12)
    # tree-shaped: the main level times tp[1][tree] / tp[1][chain] (on the TP grid: exact)
    ratio = at(TABLES["1"]["tree"], 4, 64) / at(TABLES["1"]["chain"], 4, 64)
    assert ratio > 1.01  # the synthetic tree is slower: the lookup must see it
    assert c.tree_forward("target", 4, 64) == pytest.approx(main_target(4, 64) * ratio + ACCEPT[4], rel=1e-9)


def test_tp2_scales_by_the_degrees_ratio_per_shape() -> None:
    c = tree_cost(2, profile_with_tp())
    assert c.degree == {"target": 2, "draft": 2}
    for shape in ("chain", "tree"):
        ratio = at(TABLES["2"][shape], 4, 64) / at(TABLES["1"]["chain"], 4, 64)
        got = c.forward("target", 4, 64, shape=shape)
        assert got == pytest.approx(main_target(4, 64) * ratio + ACCEPT[4], rel=1e-9)
    # outside the TP grid the ratio is read at the nearest grid edge (no wild extrapolation)
    edge = at(TABLES["2"]["chain"], 1, 512) / at(TABLES["1"]["chain"], 1, 512)
    assert c.forward("target", 1, 1024) == pytest.approx(main_target(1, 1024) * edge + ACCEPT[1], rel=1e-9)
    # the draft too (its own tables), and prefill scales with the degree
    assert c.forward("draft", 1, 64) < tree_cost(1, profile_with_tp()).forward("draft", 1, 64)
    assert c.prefill("target", 256) < tree_cost(1, profile_with_tp()).prefill("target", 256)


def test_a_transformer_drafts_tree_forward_pays_every_nodes_logits() -> None:
    # The main table times a chain step (the LM head over the last token only); a tree expansion
    # needs the logits of all k nodes. The draft's tree forward is the TP tables' tree shape from
    # one token on (every row's logits), at the main table's one-token level: growing in k as the
    # tree table does, not as the (flatter) main table does.
    for tp in (1, 2):
        c = tree_cost(tp, profile_with_tp())
        main = c._forward["draft"]
        for k, ctx in ((1, 64), (4, 64), (16, 512)):
            want = main(1, ctx) * at(TABLES[str(tp)]["tree"], k, ctx) / at(TABLES["1"]["chain"], 1, ctx)
            assert c.tree_forward("draft", k, ctx) == pytest.approx(want, rel=1e-9)
        growth_tree = c.tree_forward("draft", 16, 64) / c.tree_forward("draft", 1, 64)
        growth_main = main(16, 64) / main(1, 64)
        assert growth_tree == pytest.approx(at(TABLES[str(tp)]["tree"], 16, 64) / at(TABLES[str(tp)]["tree"], 1, 64))
        assert abs(growth_tree - growth_main) > 0.05  # the synthetic tables differ: the test can tell
    # the target's tree verification keeps the main table's level per k (it computes every row)
    c = tree_cost(2, profile_with_tp())
    ratio = at(TABLES["2"]["tree"], 4, 64) / at(TABLES["1"]["chain"], 4, 64)
    assert c.tree_forward("target", 4, 64) == pytest.approx(main_target(4, 64) * ratio + ACCEPT[4], rel=1e-9)


EAGLE_BATCH = {"greedy": {"k": [1, 2], "batch": [1, 2, 4, 8, 16], "context": 128,
                          "seconds": [[0.004, 0.005], [0.0045, 0.006], [0.005, 0.007], [0.009, 0.012], [0.018, 0.024]]}}


def eagle_tree_cost() -> ProfileCost:
    prof = make_profile()
    prof["models"]["smollm2_eagle"] = {**prof["models"]["smollm2_exit10"], "kind": "eagle", "batch": EAGLE_BATCH}
    exp = compose_exp("pair=smollm2_135m+smollm2_eagle", "hardware=local", "sim.cost_model=profile",
                      "schedule=sync", "schedule.tree=true")
    return ProfileCost(exp, profile=prof)


def test_an_eagle_heads_tree_forward_pays_every_nodes_logits() -> None:
    # The main table times the head's chain step (the LM head over the last pair only); a tree
    # expansion of k nodes needs k rows of logits: the shape of the head's batched table (the
    # layer and the LM head over B rows), read at B = k, at the main table's one-token level
    c = eagle_tree_cost()
    main, rows = c._forward["draft"], EAGLE_BATCH["greedy"]["seconds"]
    for k, b in ((1, 0), (4, 2), (8, 3), (16, 4)):
        for ctx in (64, 512):
            assert c.tree_forward("draft", k, ctx) == pytest.approx(main(1, ctx) * rows[b][0] / rows[0][0], rel=1e-9)
    growth = c.tree_forward("draft", 16, 64) / c.tree_forward("draft", 1, 64)
    assert abs(growth - main(16, 64) / main(1, 64)) > 0.05  # not the chain table's growth: the test can tell
    # several requests' expansions in one forward: the rows of all read the weights once
    two = c.batch_forward("draft", [(8, 64), (8, 64)], tree=True)
    assert two == pytest.approx(c.tree_forward("draft", 16, 0) + 2 * (c.tree_forward("draft", 8, 64)
                                                                     - c.tree_forward("draft", 8, 0)), rel=1e-9)
    assert two < 2 * c.tree_forward("draft", 8, 64) * 1.01


def test_degree_follows_the_layout() -> None:
    # the serial tree runs both models on max(target_gpus, draft_gpus) devices
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "schedule=sync", "schedule.tree=true",
                      "placement.target_gpus=2", "placement.draft_gpus=1")
    assert tp_degrees(exp) == {"target": 2, "draft": 2}
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "schedule=sync", "placement.target_gpus=1")
    assert tp_degrees(exp) == {"target": 1, "draft": 1}


def test_schema1_profile_serves_tp1_and_names_the_fix_at_tp2() -> None:
    old = make_profile()
    old["schema"] = 1
    old["models"]["smollm2_draft"] = {**old["models"]["smollm2_exit10"], "kind": "transformer"}
    c = tree_cost(1, old)
    assert c.tree_forward("target", 4, 256) == c.forward("target", 4, 256)  # no shape tables: chain
    with pytest.raises(ConfigError, match=r"placement.target_gpus.*no tensor-parallel tables.*\+calibrate"):
        tree_cost(2, old)
    prof = profile_with_tp()
    prof["models"]["smollm2_135m"]["tp"] = {"1": TABLES["1"]}  # measured on one core only
    with pytest.raises(ConfigError, match="a TP degree the profile"):
        tree_cost(2, prof)


# ------------------------------------------------------------------------ trace of a serial tree
N_TOKENS = 40
WIDTH, BUDGET, DEPTH = 2, 6, 3


def write_tree_run(path: Path, accepted: list[list[int]], split: str = "trace", *,
                   pair: str = "smollm2_135m+smollm2_draft", schedule: list[str] | None = None,
                   drafted: list[list[int]] | None = None) -> None:
    exp = compose_exp("backend=real", f"pair={pair}", *(schedule or ["schedule=sync", "schedule.tree=true"]),
                      f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}",
                      f"schedule.gamma={DEPTH}", f"workload.split={split}", "workload=humaneval",
                      f"workload.max_new_tokens={N_TOKENS}")
    rec = RunRecorder()
    for rid, rounds in enumerate(accepted):
        t, generated = 0.0, 0
        for i, n in enumerate(rounds):
            e = min(n + 1, N_TOKENS - generated)
            d = drafted[rid][i] if drafted else BUDGET - 1
            rec.round(request_id=rid, round_idx=i, start_s=t, end_s=t + 0.01, drafted=d,
                      checked=n + (d > 0), accepted=n, emitted=e, verified_tokens=d + 1, draft_s=0.004,
                      target_s=0.006)
            t += 0.01
            generated += e
        assert generated == N_TOKENS
        rec.request(RequestRecord(request_id=rid, prompt_id=f"p{rid}", prompt_len=50, output_ids=[],
            generated=N_TOKENS, prefill_s=0.1, decode_s=t, rounds=len(rounds)))
    write_run(path, exp, RunResult(recorder=rec, extra={"tree_width": WIDTH, "tree_budget": BUDGET,
                                                        "tree_depth_used": DEPTH}))


def test_trace_replays_a_serial_tree_runs_accepted_counts(tmp_path: Path) -> None:
    # accepted counts within the tree's depth (3), each request emitting exactly N_TOKENS
    recorded = [[3, 0, 2, 1, 3, 3, 0, 2, 1, 3, 3, 2, 1, 3, 0, 1, 1], [0, 0, 1, 3, 3, 3, 2, 2, 3, 3, 1, 3, 3, 2]]
    recorded = [r[: next(i for i in range(len(r) + 1) if sum(x + 1 for x in r[:i]) >= N_TOKENS)] for r in recorded]
    recorded[0][-1] = N_TOKENS - sum(x + 1 for x in recorded[0][:-1]) - 1
    recorded[1][-1] = N_TOKENS - sum(x + 1 for x in recorded[1][:-1]) - 1
    write_tree_run(tmp_path / "real", recorded)
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=analytic",
                      "schedule=sync", "schedule.tree=true", f"schedule.tree_width={WIDTH}",
                      f"schedule.tree_budget={BUDGET}", f"schedule.gamma={DEPTH}", "workload=humaneval",
                      "workload.split=test", "workload.num_prompts=2", f"workload.max_new_tokens={N_TOKENS}",
                      "acceptance=trace", f"acceptance.trace_path={tmp_path}")
    rounds, _, _ = sim_run(exp).recorder.frames()
    for rid, want in enumerate(recorded):
        assert rounds[rounds["request_id"] == rid]["accepted"].tolist() == want


def test_trace_of_chains_does_not_drive_a_tree(tmp_path: Path) -> None:
    from tests.sim.test_oracle_trace import write_trace_run

    write_trace_run(tmp_path / "chain", gamma=3, split="trace")
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=analytic",
                      "schedule=sync", "schedule.tree=true", "workload=humaneval", "workload.split=test",
                      "workload.num_prompts=1", "acceptance=trace", f"acceptance.trace_path={tmp_path}")
    with pytest.raises(ConfigError, match="recorded sync_tree run"):
        sim_run(exp)


@pytest.mark.parametrize("schedule", ["sync_tree", "async"])
def test_trace_replays_the_rounds_an_ngram_tree_drafted_nothing(tmp_path: Path, schedule: str) -> None:
    """A recorded round that drafted nothing (the n-gram found no continuation) verifies the
    root alone in the replay too: a one-token forward, not a batch of bs."""
    rng = random.Random(7)
    recorded: list[list[tuple[int, int]]] = []
    for _ in range(2):
        rounds, generated = [], 0
        while generated < N_TOKENS:
            d = rng.choice([0, 0, BUDGET - 1])
            # within the depth of a batch grown from a fresh root (async sends one after every
            # round that drafted nothing)
            n = min(rng.choice([DEPTH - 1, DEPTH - 1, 1]) if d else 0, N_TOKENS - generated - 1)
            rounds.append((d, n))
            generated += n + 1
        recorded.append(rounds)
    sched = ["schedule=async"] if schedule == "async" else ["schedule=sync", "schedule.tree=true"]
    write_tree_run(tmp_path / "real", [[n for _, n in r] for r in recorded], pair="smollm2_135m+ngram3",
                   schedule=sched, drafted=[[d for d, _ in r] for r in recorded])
    exp = compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=analytic", *sched,
                      f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}", f"schedule.gamma={DEPTH}",
                      "workload=humaneval", "workload.split=test", "workload.num_prompts=2",
                      f"workload.max_new_tokens={N_TOKENS}", "acceptance=trace", f"acceptance.trace_path={tmp_path}")
    rounds, _, _ = sim_run(exp).recorder.frames()
    for rid, want in enumerate(recorded):
        got = rounds[rounds["request_id"] == rid]
        barren = [d == 0 for d, _ in want]
        assert [v == 1 for v in got["verified_tokens"]] == barren
        assert got["accepted"].tolist() == [n for _, n in want]
