"""The n-gram draft (testbed.spec.ngram): the chain lookup, the tree's count distribution, and
`async` with the n-gram draft in the simulator (synthetic oracle: output = greedy `ar`)."""

from __future__ import annotations

import pytest
import torch

from testbed.spec.ngram import NgramTreeSource, ngram_counts, ngram_lookup
from testbed.spec.tree_drafter import TreeDrafter
from tests.conftest import compose_exp


def test_counts_rank_continuations_by_frequency_and_the_chain_guess_first_on_ties() -> None:
    ids = [7, 1, 7, 2, 7, 1, 7, 3, 7]
    w = ngram_counts(ids, ngram=1)
    assert sorted(w, key=w.get, reverse=True) == [1, 3, 2]  # 1 twice; 3 newer than 2
    assert ngram_lookup(ids, ngram=1, gamma=1) == [3]  # the chain takes the latest
    tie = [4, 5, 4, 6, 4]
    w = ngram_counts(tie, ngram=2)
    assert max(w, key=w.get) == ngram_lookup(tie, ngram=2, gamma=1)[0] == 6
    assert ngram_counts([1, 2, 3], ngram=3) == {}


def test_the_tree_source_grows_branches_from_the_counts() -> None:
    src = NgramTreeSource([9, 1, 9, 2, 9, 1, 9], ngram=1, vocab=12)
    drafter = TreeDrafter(src, width=2, budget=4)
    drafter.fill()
    tree = drafter.tree
    assert sorted(tree.tokens[c] for c in tree.children[0]) == [1, 2]
    q = tree.dists[0]
    assert q is not None and torch.isclose(q.sum(), torch.tensor(1.0)) and q[1] > q[2] > 0
    assert len(tree) >= 4


@pytest.mark.parametrize("seed", [0, 1])
def test_sim_async_with_the_ngram_draft_emits_the_ar_output(seed: int) -> None:
    from sim.runtime.engine import run

    base = ("pair=smollm2_135m+ngram3", "acceptance=synthetic", "acceptance.vocab=8",
            "sampling.temperature=0", "workload.num_prompts=3", "workload.max_new_tokens=40",
            f"seed={seed}")
    ar = run(compose_exp("schedule=ar", *base)).recorder.frames()[1]
    res = run(compose_exp("schedule=async", "hardware=local", "schedule.tree_width=2",
                          "schedule.tree_budget=5", *base))
    rounds, req, _ = res.recorder.frames()
    assert [list(x) for x in req["output_ids"]] == [list(x) for x in ar["output_ids"]]
    assert rounds.accepted.sum() > 0  # a small vocabulary repeats: lookups propose tokens
