"""Contention of async's two groups on a CPU: the profile's ``contended`` tables slow the
simulator's async forwards (and only async's), and real/calibrate/contention.py measures them
with two pinned workers (tiny models)."""

from __future__ import annotations

import math
from pathlib import Path

import psutil
import pytest

from sim.cost.profile import ProfileCost
from testbed.config import real_dtype
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.sim.test_cost_profile_tp import profile_with_tp

FACTOR = {"k": [1, 8], "context": 256, "factor": [1.2, 1.5]}


def contended_profile() -> dict:
    prof = profile_with_tp()
    prof["models"]["smollm2_135m"]["contended"] = {"smollm2_draft": FACTOR}
    prof["models"]["smollm2_draft"]["contended"] = {"smollm2_135m": {**FACTOR, "factor": [1.1, 1.1]}}
    return prof


def _cost(schedule: str, profile: dict) -> ProfileCost:
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                      f"schedule={schedule}", "placement.target_gpus=1", "placement.draft_gpus=1")
    return ProfileCost(exp, profile=profile)


def test_async_forwards_are_slowed_by_the_measured_factor_and_sync_ones_not() -> None:
    plain, busy = _cost("async", profile_with_tp()), _cost("async", contended_profile())
    for role, k, want in (("target", 1, 1.2), ("target", 4, 1.2 + 0.3 * 3 / 7), ("target", 16, 1.5),
                          ("draft", 4, 1.1)):
        assert busy.contention_factor(role, k) == pytest.approx(want)
        got = busy._forward_unscaled(role, k, context=256, layers=None, shape="tree") - (busy._accept(k) if role == "target" else 0)
        ref = plain._forward_unscaled(role, k, context=256, layers=None, shape="tree") - (plain._accept(k) if role == "target" else 0)
        assert got == pytest.approx(ref * want)
    sync = _cost("sync", contended_profile())
    assert sync.contention_factor("target", 8) == 1.0


def test_sim_async_reports_the_contention_it_used(tmp_path: Path) -> None:
    import json

    from sim.runtime.engine import run

    path = tmp_path / "local.json"
    path.write_text(json.dumps(contended_profile()))
    res = run(compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                          f"sim.profile_path={path}", "schedule=async", "schedule.tree_budget=8",
                          "schedule.tree_width=4", "workload.num_prompts=1", "workload.max_new_tokens=16"))
    assert res.extra["contention_target"] == pytest.approx(1.5)
    assert res.extra["contention_draft"] == pytest.approx(1.1)


@pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2, reason="needs two cores")
@pytest.mark.parametrize("kind", ["transformer", "eagle"])
def test_contention_is_measured_with_two_pinned_workers(tmp_path: Path, kind: str) -> None:
    """A draft model's or an eagle head's tree forwards beside the target's (the head: its layer
    and the target's LM head over every node, on the target rank 0 loaded first)."""
    from real.calibrate.contention import ContentionGrid, measure_contention
    from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "t", seed=1, layers=2)
    if kind == "eagle":
        from real.model.eagle import EagleHead, save_head
        from real.model.weights import load_model

        draft = tmp_path / "d"
        save_head(EagleHead(load_model(target, max_seq=16)[0].args).init_random(3), draft, target_name="tiny")
    else:
        draft = write_tiny_checkpoint(tmp_path / "d", seed=2, layers=1)
    exp = compose_exp("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}")
    grid = ContentionGrid(k=[1, 4], context=16, busy_k=4, repeats=2)
    lines: list[str] = []
    tables = measure_contention(exp, {"t": str(target), "d": str(draft)}, grid, log=lines.append)
    assert set(tables) == {"t", "d"} and set(tables["t"]) == {"d"} and set(tables["d"]) == {"t"}
    for by in tables.values():
        for t in by.values():
            assert t["k"] == [1, 4] and len(t["factor"]) == 2
            assert all(f > 0 for f in t["factor"]) and all(s > 0 for s in t["alone_s"] + t["busy_s"])
    assert any("while d runs on the other core" in line for line in lines)
    assert live_workers() == []


def test_async_prediction_replays_the_async_run_before_a_serial_tree(tmp_path: Path) -> None:
    """acceptance=trace for async: the recorded async run of the same shape, not a sync_tree one."""
    import json

    from sim.oracle.trace import select_trace_runs
    from tests.sim.test_cost_profile_tp import BUDGET, WIDTH, write_tree_run

    write_tree_run(tmp_path / "tree", [[0] * 39 + [0]])
    write_tree_run(tmp_path / "async", [[0] * 39 + [0]])
    summary = tmp_path / "async" / "summary.json"
    s = json.loads(summary.read_text())
    summary.write_text(json.dumps({**s, "schedule": "async", "target_gpus": 1, "draft_gpus": 1}))
    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "schedule=async",
                      f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}", "workload=humaneval",
                      "workload.split=test", "acceptance=trace", f"acceptance.trace_path={tmp_path}")
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["async"]
    (tmp_path / "async" / "summary.json").unlink()
    assert [d.name for d, _ in select_trace_runs(tmp_path, exp)] == ["tree"]  # the fallback


def test_async_depth_is_chosen_from_each_forward_alone(tmp_path: Path) -> None:
    """d = round(t_target / t_draft) from the uncontended forwards, as the real backend times
    them (one after the other): contention slows the run's forwards, not the choice of d."""
    import json

    from sim.runtime.engine import run

    runs = {}
    for name, prof in (("plain", profile_with_tp()), ("busy", contended_profile())):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(prof))
        runs[name] = run(compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                                     f"sim.profile_path={path}", "schedule=async", "schedule.tree_budget=8",
                                     "schedule.tree_width=4", "workload.num_prompts=1", "workload.max_new_tokens=16"))
    plain, busy = runs["plain"].extra, runs["busy"].extra
    assert busy["t_target_ms"] == pytest.approx(plain["t_target_ms"])
    assert busy["t_draft_ms"] == pytest.approx(plain["t_draft_ms"])
    assert busy["tree_depth_used"] == plain["tree_depth_used"]
    # while the run's forwards are slowed (1.5x target at bs = 8): the run takes longer
    def decode_s(name: str) -> float:
        return float(runs[name].recorder.frames()[1]["decode_s"].sum())
    assert decode_s("busy") > decode_s("plain")


def test_async_depth_counts_the_whole_expansion_the_draft_is_charged(tmp_path: Path) -> None:
    """t_draft is one whole expansion (forward + tree_expand_extra), as the simulator charges it
    and the real backend times it (TreeDrafter.expand): an expansion overhead lowers d."""
    import json

    from sim.runtime.engine import run

    runs = {}
    for name, extra_s in (("bare", None), ("overhead", 0.004)):
        prof = profile_with_tp()
        if extra_s is not None:
            prof["models"]["smollm2_draft"]["tree_expand"] = {
                "greedy": {"leaves": [1, 16], "seconds": [extra_s, extra_s]}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(prof))
        runs[name] = run(compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                                     f"sim.profile_path={path}", "schedule=async", "schedule.tree_budget=8",
                                     "schedule.tree_width=4", "workload.num_prompts=1",
                                     "workload.max_new_tokens=16")).extra
    bare, over = runs["bare"], runs["overhead"]
    assert over["t_draft_ms"] == pytest.approx(bare["t_draft_ms"] + 4.0)
    assert over["t_target_ms"] == pytest.approx(bare["t_target_ms"])
    assert over["tree_depth_used"] == math.floor(over["t_target_ms"] / over["t_draft_ms"] + 0.5)
    assert over["tree_depth_used"] < bare["tree_depth_used"]


def _runs_with_and_without_tree_rounds(tmp_path: Path, width: int, *overrides: str) -> dict:
    """Simulated runs of the bundled pair without the tree bookkeeping table ("bare") and with
    one that charges 2 ms select and 6 ms re-root at tree width ``width`` (midway in leaves)."""
    import json

    from sim.runtime.engine import run

    runs = {}
    for name in ("bare", "bookkeeping"):
        prof = profile_with_tp()
        if name == "bookkeeping":
            prof["models"]["smollm2_draft"]["tree_rounds"] = {"greedy": {
                "leaves": [1, 2 * width - 1], "select_s": [0.0, 0.004], "advance_s": [0.0, 0.012]}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(prof))
        runs[name] = run(compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                                     f"sim.profile_path={path}", f"schedule.tree_width={width}",
                                     "schedule.tree_budget=8", "workload.num_prompts=1",
                                     "workload.max_new_tokens=24", *overrides))
    return runs


def test_async_charges_the_draft_its_select_and_reroot_every_round(tmp_path: Path) -> None:
    """real/calibrate/tree.time_bookkeeping's table: each round the draft group is busy for
    select + pack before it sends a subtree and for re-root + KV compaction after the verified
    tokens arrive (seconds interpolated by the tree width, as spans of their own), and the
    target, which waits for the next subtree, loses that time too. d is not changed by it."""
    runs = _runs_with_and_without_tree_rounds(tmp_path, 8, "schedule=async")
    spans = {name: r.recorder.frames()[2] for name, r in runs.items()}
    assert not spans["bare"]["kind"].isin(["select", "reroot"]).any()
    book = spans["bookkeeping"]
    rounds = int(runs["bookkeeping"].recorder.frames()[1]["rounds"].sum())
    select, reroot = book[book["kind"] == "select"], book[book["kind"] == "reroot"]
    assert len(select) == rounds and len(reroot) == rounds - 1  # no re-root after the last round
    assert (select["end_s"] - select["start_s"]).to_numpy() == pytest.approx([0.002] * rounds)  # w = 8: midway
    assert (reroot["end_s"] - reroot["start_s"]).sum() == pytest.approx(0.006 * (rounds - 1))
    assert runs["bookkeeping"].extra["tree_depth_used"] == runs["bare"].extra["tree_depth_used"]
    decode = {name: float(r.recorder.frames()[1]["decode_s"].sum()) for name, r in runs.items()}
    assert decode["bookkeeping"] > decode["bare"] + 0.006 * (rounds - 1)


def _current_profile(exp) -> dict:  # type: ignore[no-untyped-def]
    """A fabricated profile with every table the pre-run check asks of ``exp``'s pair."""
    from real.calibrate.profile import SCHEMA

    prof = profile_with_tp()
    prof.update(schema=SCHEMA, dtype=real_dtype(exp), probe={
        "gbps": 10.0, "forward_s": {name: 0.01 for name in prof["models"]}})
    return prof


def test_a_profile_without_the_async_bookkeeping_table_is_measured_again(tmp_path: Path) -> None:
    """A profile from before the table (a tree-expansion table, no "tree_rounds") would have
    async predictions charge no select or re-root: the sweep's EnsureProfile re-measures it."""
    import json

    from real.calibrate.ensure_profile import profile_is_current

    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "backend=real")
    prof = _current_profile(exp)
    prof["models"]["smollm2_draft"]["tree_expand"] = {"greedy": {"leaves": [1, 16], "seconds": [0.001, 0.002]}}
    path = tmp_path / "local.json"
    path.write_text(json.dumps(prof))
    current, why = profile_is_current(path, exp)
    assert not current and "tree bookkeeping" in why and "smollm2_draft" in why
    prof["models"]["smollm2_draft"]["tree_rounds"] = {"greedy": {"leaves": [1], "select_s": [0.0], "advance_s": [0.0]}}
    path.write_text(json.dumps(prof))
    assert profile_is_current(path, exp) == (True, "current")


def test_the_serial_tree_charges_select_in_its_draft_phase_and_reroot_between_rounds(tmp_path: Path) -> None:
    """The same table serves `sync` + tree: the real serial tree selects inside its draft phase
    and re-roots after the verification, before the next round starts."""
    runs = _runs_with_and_without_tree_rounds(tmp_path, 4, "schedule=sync", "schedule.tree=true", "schedule.gamma=2")
    frames = {name: r.recorder.frames() for name, r in runs.items()}
    rounds = {name: f[0] for name, f in frames.items()}
    # the same acceptance (same draws), each round's draft phase 2 ms longer (w = 4: midway)
    assert len(rounds["bookkeeping"]) == len(rounds["bare"])
    assert (rounds["bookkeeping"]["draft_s"] - rounds["bare"]["draft_s"]).to_numpy() == pytest.approx(
        [0.002] * len(rounds["bare"]))
    spans = frames["bookkeeping"][2]
    reroot = spans[spans["kind"] == "reroot"]
    assert len(reroot) == len(rounds["bare"]) and not (frames["bare"][2]["kind"] == "reroot").any()
    assert (reroot["end_s"] - reroot["start_s"]).to_numpy() == pytest.approx([0.006] * len(reroot))
    decode = {name: float(f[1]["decode_s"].sum()) for name, f in frames.items()}
    assert decode["bookkeeping"] == pytest.approx(decode["bare"] + 0.008 * len(rounds["bare"]))


def test_async_depth_of_an_ngram_draft_times_the_real_probes_one_leaf_expansion(tmp_path: Path) -> None:
    """The real probe's n-gram tree is a chain (one leaf per expansion, see choose_depth):
    t_draft is the table's one-leaf expansion, not the four leaves the rounds then charge."""
    import json

    from sim.runtime.engine import run

    prof = profile_with_tp()
    prof["models"]["ngram3"] = {**prof["models"].get("ngram3", {}), "tree_expand": {
        "greedy": {"leaves": [1, 4], "seconds": [0.001, 0.004]}}}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    x = run(compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile",
                        f"sim.profile_path={path}", "schedule=async", "schedule.tree_budget=8",
                        "schedule.tree_width=4", "workload.num_prompts=1", "workload.max_new_tokens=16")).extra
    assert x["t_draft_ms"] == pytest.approx(1.0)
    assert x["tree_depth_used"] == min(64, math.floor(x["t_target_ms"] / 1.0 + 0.5))


@pytest.mark.parametrize("table", ["tree_expand", "batch"])
def test_a_profile_without_an_eagle_heads_tree_or_batched_table_is_measured_again(tmp_path: Path, table: str) -> None:
    """An eagle head's tree expansions are costed from its batched table and its calibrated
    expansion overhead: a profile from before either would charge a tree expansion as the head's
    chain step, so the sweep's EnsureProfile re-measures it."""
    import json

    from real.calibrate.ensure_profile import profile_is_current

    exp = compose_exp("pair=smollm2_135m+smollm2_eagle", "hardware=local", "backend=real")
    prof = _current_profile(exp)
    path = tmp_path / "local.json"
    path.write_text(json.dumps(prof))
    assert profile_is_current(path, exp) == (True, "current")
    del prof["models"]["smollm2_eagle"][table]
    path.write_text(json.dumps(prof))
    current, why = profile_is_current(path, exp)
    assert not current and "smollm2_eagle" in why


def test_a_profile_measured_with_other_kernels_or_algorithms_is_stale_and_warns_once(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The profile records a digest of the sources it times (kernels, models, testbed/spec): a
    sweep re-measures one from other code, and a prediction from it says so once."""
    import json
    import logging

    from real.calibrate.ensure_profile import profile_is_current
    from sim.cost.profile import ProfileCost
    from testbed.paths import timed_code_digest

    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "backend=real")
    prof = _current_profile(exp)
    path = tmp_path / "local.json"
    path.write_text(json.dumps(prof))
    assert prof["code"] == timed_code_digest() and profile_is_current(path, exp) == (True, "current")
    prof["code"] = "0" * 16
    path.write_text(json.dumps(prof))
    current, why = profile_is_current(path, exp)
    assert not current and "other code" in why and "specbed_kernels" in why
    sim_exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile")
    with caplog.at_level(logging.WARNING, logger="sim.cost.profile"):
        for _ in range(2):
            ProfileCost(sim_exp, profile=prof, path=path)
    assert sum("other code" in r.getMessage() for r in caplog.records) == 1
