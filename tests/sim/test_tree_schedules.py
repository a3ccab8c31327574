"""`async` (SwiftSpec) and `sync_tree` (SwiftSpec-base) in the simulator.

- At temperature 0 on the synthetic oracle both emit exactly what greedy `ar` emits (several
  seeds and tree shapes): they never emit a token the target would not have emitted.
- The i.i.d. rank model (sim.oracle.tree_tokens) reduces to Leviathan's model on a chain and accepts a
  node verified with m candidates with probability 1 − (1−α)^m.
- Under the roofline with a draft much faster than the target, `async` beats `sync_tree` on the
  same pair and node, and its timeline shows the draft working while the target verifies.
"""

from __future__ import annotations

import functools
import math
import random

import pytest

from sim.oracle.tree_tokens import IidTreeTokens
from sim.runtime.engine import run
from testbed.results import build_summary
from testbed.spec.tree import DraftTree
from testbed.theory import expected_tokens, leviathan_speedup
from tests.conftest import compose_exp

GREEDY = ("acceptance=synthetic", "sampling.temperature=0", "workload.num_prompts=2",
          "workload.max_new_tokens=48")


@functools.cache
def ar_outputs(seed: int, alpha: float) -> list[list[int]]:
    req = run(compose_exp("schedule=ar", *GREEDY, f"seed={seed}",
                          f"acceptance.alpha={alpha}")).recorder.frames()[1]
    return [list(x) for x in req["output_ids"]]


SHAPES = [  # (overrides, seed, alpha)
    (("schedule=async", "placement.target_gpus=5", "placement.draft_gpus=3"), 0, 0.8),
    (("schedule=async", "placement.target_gpus=2", "placement.draft_gpus=6",
      "schedule.tree_width=4", "schedule.tree_budget=6", "schedule.tree_depth=2"), 1, 0.8),
    (("schedule=async", "placement.target_gpus=7", "placement.draft_gpus=1",
      "schedule.tree_width=2", "schedule.tree_budget=12", "schedule.tree_depth=5"), 2, 0.6),
    (("schedule=async", "placement.target_gpus=4", "placement.draft_gpus=4",
      "schedule.tree_width=1", "schedule.tree_budget=3", "schedule.tree_depth=1"), 0, 0.6),
    (("schedule=sync", "schedule.tree=true"), 1, 0.8),
    (("schedule=sync", "schedule.tree=true", "schedule.tree_width=3", "schedule.tree_budget=5",
      "schedule.tree_depth=2"), 2, 0.8),
    (("schedule=sync", "schedule.tree=true", "schedule.tree_width=16", "schedule.tree_budget=16",
      "schedule.tree_depth=3"), 0, 0.6),
]


@pytest.mark.parametrize("overrides,seed,alpha", SHAPES)
def test_greedy_tree_output_is_ar_output(overrides: tuple[str, ...], seed: int, alpha: float) -> None:
    exp = compose_exp(*overrides, *GREEDY, f"seed={seed}", f"acceptance.alpha={alpha}")
    res = run(exp)
    rounds, req, _ = res.recorder.frames()
    assert [list(x) for x in req["output_ids"]] == ar_outputs(seed, alpha)
    assert (req["generated"] == 48).all()
    assert rounds.groupby("request_id")["emitted"].sum().eq(48).all()
    assert (rounds["verified_tokens"] <= exp.schedule.tree_budget).all()
    # the tree is worth it: more than one token per verification on average
    assert build_summary(exp, res)["mean_accepted_len"] > 1.2


def test_iid_chain_reduces_to_leviathan() -> None:
    """A tree of width 1 (a chain of γ) under the rank model is Theorem 3.8's setting."""
    alpha, gamma, c = 0.7, 4, 0.05
    exp = compose_exp("schedule=sync", "schedule.tree=true", "schedule.tree_width=1",
                      f"schedule.tree_budget={gamma + 1}", f"schedule.tree_depth={gamma}",
                      "sim.cost_model=analytic", f"sim.c={c}", "acceptance=iid",
                      f"acceptance.alpha={alpha}", "workload.num_prompts=4",
                      "workload.max_new_tokens=3000")
    s = build_summary(exp, run(exp))
    assert s["alpha"] == pytest.approx(alpha, abs=0.02)
    assert s["mean_accepted_len"] == pytest.approx(expected_tokens(alpha, gamma), rel=0.03)
    assert s["speedup"] == pytest.approx(leviathan_speedup(alpha, gamma, c), rel=0.03)


def test_iid_rank_model_accepts_m_candidates_with_one_minus_miss_power_m() -> None:
    alpha, width, m = 0.6, 8, 3
    toks = IidTreeTokens(alpha, width, random.Random(7))
    tree = DraftTree(root_token=-1)
    tree.expand([0], toks.draft_dists(tree, [0]), num_children=width)
    batch = tree.select_subtree(m + 1)  # the root and its m best children
    assert batch.tokens[1:] == list(range(m))
    n = 20000
    outcomes = [toks.verify(batch, []) for _ in range(n)]
    hit = sum(o.accepted for o in outcomes) / n
    assert hit == pytest.approx(1 - (1 - alpha) ** m, abs=0.01)
    assert all(o.checked == o.accepted + (o.accepted == 0) for o in outcomes)
    # the bonus after a miss is the target's rank: a child outside the batch (kept by the
    # re-root) with the geometric law's probability
    outside = sum(1 for o in outcomes if not o.accepted and o.tokens[0] < width) / n
    assert outside == pytest.approx((1 - alpha) ** m - (1 - alpha) ** width, abs=0.01)


ROOFLINE = ("pair=llama3_70b+llama3_2_1b", "hardware=h800x8", "workload.num_prompts=2",
            "workload.max_new_tokens=96")


def test_async_beats_serial_tree_when_the_draft_is_much_faster() -> None:
    a_exp = compose_exp("schedule=async", "placement.target_gpus=6", "placement.draft_gpus=2", *ROOFLINE)
    a_res = run(a_exp)
    a = build_summary(a_exp, a_res)
    s_exp = compose_exp("schedule=sync", "schedule.tree=true", *ROOFLINE)
    s = build_summary(s_exp, run(s_exp))
    assert a["t_draft_ms"] * 3 < a["t_target_ms"]  # the premise: t_draft << t_target
    assert a["tokens_per_s"] > 1.2 * s["tokens_per_s"]
    # d as SwiftSpec sets it: floor(t_target / t_draft) or one more, whichever is closer
    assert a["tree_depth_used"] == math.floor(a["t_target_ms"] / a["t_draft_ms"] + 0.5)
    # the overlap is real: the draft expands while the target verifies
    tl = a_res.recorder.frames()[2]
    tl = tl[tl["request_id"] == 0]
    draft = tl[(tl["resource"] == "draft") & (tl["kind"] == "expand")]
    verify = tl[(tl["resource"] == "target") & (tl["kind"] == "verify")]
    d_iv = list(zip(draft["start_s"], draft["end_s"]))
    overlap = sum(max(0.0, min(e, ve) - max(s_, vs)) for vs, ve in zip(verify["start_s"], verify["end_s"])
                  for s_, e in d_iv)
    assert overlap > 0.5 * (verify["end_s"] - verify["start_s"]).sum()
    assert {"link draft->target", "link target->draft"} <= set(tl["resource"])


def test_async_keeps_tree_kv_and_reports_its_knobs() -> None:
    exp = compose_exp("schedule=async", "placement.target_gpus=4", "placement.draft_gpus=4",
                      "schedule.tree_depth=4", "workload.num_prompts=1", "workload.max_new_tokens=64")
    s = build_summary(exp, run(exp))
    assert s["tree_depth_used"] == 4 and s["tree_width"] == 8 and s["tree_budget"] == 8
    assert 0.0 < s["tree_kv_reuse"] <= 1.0


def test_sampled_trees_run_at_temperature_one() -> None:
    """Sample-mode trees and the multi-candidate rule: runs, emits every token, accepts some."""
    for sched in (("schedule=async", "placement.target_gpus=5", "placement.draft_gpus=3"),
                  ("schedule=sync", "schedule.tree=true")):
        exp = compose_exp(*sched, "acceptance=synthetic", "sampling.temperature=1",
                          "workload.num_prompts=1", "workload.max_new_tokens=40")
        res = run(exp)
        req = res.recorder.frames()[1]
        assert len(req["output_ids"][0]) == 40
        assert all(0 <= t < exp.acceptance.vocab for t in req["output_ids"][0])
        assert build_summary(exp, res)["mean_accepted_len"] > 1.2


def test_an_eagle_heads_async_starts_after_the_targets_prompt_features_arrive() -> None:
    """The head reads the target's features: its prefill follows the target's and the message of
    the prompt's features (as real/runtime/async_messages.py sends it); a separate draft model
    prefills beside the target."""
    for pair, eagle in (("llama3_8b+llama3_8b_eagle", True), ("llama3_8b+llama3_2_1b", False)):
        exp = compose_exp("schedule=async", f"pair={pair}", "hardware=h100x8", "placement.target_gpus=4",
                          "placement.draft_gpus=4", "workload.num_prompts=1", "workload.max_new_tokens=16",
                          "network.latency_ms=0")
        result = run(exp)
        tl = result.recorder.frames()[2]
        target = tl[(tl.resource == "target") & (tl.kind == "prefill")].iloc[0]
        draft = tl[(tl.resource == "draft") & (tl.kind == "prefill")].iloc[0]
        links = tl[tl.resource.str.startswith("link target")]
        if eagle:
            feats = links[links.start_s >= target.end_s - 1e-12].iloc[0]
            assert feats.start_s == pytest.approx(target.end_s) and draft.start_s == pytest.approx(feats.end_s)
            assert feats.end_s > feats.start_s  # the prompt's features take wire time
        else:
            assert draft.start_s == target.start_s == 0.0
