"""testbed.spec.tree_drafter: the time-free draft side of tree schedules, driven by a toy
DraftSource (what a model-backed source sees: the nodes to expand, the commits, the KV plans)."""

from __future__ import annotations

import torch

from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import DraftSource, TreeDrafter, TreeKvStats
from testbed.spec.tree_io import KVCompactionPlan

VOCAB = 16


class CountingSource(DraftSource):
    """A fixed distribution favouring tokens 1, 2, 3, ...; records every call."""

    def __init__(self) -> None:
        self.tokens = [5, 7]
        self.asked: list[list[int]] = []
        self.plans: list[KVCompactionPlan] = []
        self.row = torch.softmax(-torch.arange(VOCAB, dtype=torch.float), 0).roll(1)

    def history(self) -> list[int]:
        return self.tokens

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        self.asked.append(list(nodes))
        return self.row.expand(len(nodes), VOCAB)

    def commit(self, tokens: list[int]) -> None:
        self.tokens = self.tokens + tokens

    def compact(self, plan: KVCompactionPlan) -> None:
        self.plans.append(plan)


def test_expand_fill_select_advance() -> None:
    src, kv = CountingSource(), TreeKvStats()
    d = TreeDrafter(src, width=2, budget=5, kv=kv)
    assert d.tree.prefix_len == 1 and d.tree.tokens[0] == 7  # rooted at the last committed token
    first = d.expand()
    assert first is not None and first.leaves == [0] and first.recompute == 0
    assert first.context_len == 1 and len(d.tree) == 3  # root + 2 children
    steps = d.fill()
    assert len(d.tree) >= 5 and all(s.n_inputs == len(s.leaves) for s in steps)
    assert src.asked[0] == [0] and all(len(a) <= 2 for a in src.asked)
    batch = d.select()
    assert len(batch) == 5 and batch.parents[0] == -1
    # the target accepts the first child (token 1) and emits 9, which is not in the tree
    plan = d.advance([1, 9])
    assert src.tokens == [5, 7, 1, 9] and src.plans == [plan]
    assert d.tree.prefix_len == 3 and d.tree.tokens[0] == 9
    assert plan.recompute == () and kv.kept == len(plan.keep) + len(plan.to_prefix)
    assert kv.freed == len(plan.free)
    fields = d.summary_fields()
    assert fields["tree_width"] == 2 and fields["tree_budget"] == 5
    assert fields["tree_kv_reuse"] == kv.reuse and 0.0 < kv.reuse < 1.0


def test_verified_tokens_without_draft_kv_are_fed_with_the_next_expansion() -> None:
    src = CountingSource()
    d = TreeDrafter(src, width=2, budget=3)
    d.expand()  # only the root has KV; its children (tokens 1, 2) do not
    plan = d.advance([1, 9])
    assert plan.recompute == (2,)  # token 1 sits at position 2 and was never a draft input
    nxt = d.expand()
    assert nxt is not None and nxt.recompute == 1 and nxt.n_inputs == len(nxt.leaves) + 1
    again = d.expand()
    assert again is not None and again.recompute == 0  # charged once
