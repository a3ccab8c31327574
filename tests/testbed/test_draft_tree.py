"""DraftTree: unit tests and hypothesis properties over random expand / select / re-root runs.

The KV cache is modelled as a list whose entry at each cache index is the *context* (the tuple
of tokens from the start of the sequence up to and including the token) whose KV it holds. A
correct layout has, at prefix position i, the first i+1 verified tokens, and at tree slot s the
context of the node that owns slot s; a correct mask lets a token see exactly its context.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.tree import DraftTree
from tests.helpers.spec_oracle import single_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _dists(gen: torch.Generator, rows: int, vocab: int, top_k: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    return standardize(logits, SamplingParams(temperature=1.0, top_k=top_k))


class KVModel:
    """The draft's KV cache as a list of contexts, kept in step with a DraftTree."""

    def __init__(self, tree: DraftTree, history: list[int]) -> None:
        self.tree = tree
        self.history = history  # verified tokens before the root
        self.cache: list[tuple[int, ...]] = [tuple(history[: i + 1]) for i in range(len(history))]

    def context(self, node: int) -> tuple[int, ...]:
        return tuple(self.history) + tuple(self.tree.path_tokens(node))

    def expand(self, nodes: list[int], dists: torch.Tensor, c: int, gen: torch.Generator) -> None:
        tree = self.tree
        mask = tree.expansion_mask(nodes)
        width = tree.prefix_len + tree.n_slots
        assert mask.shape == (len(nodes), width + len(nodes))
        assert torch.equal(tree.expansion_mask(nodes, include_prefix=False), mask[:, tree.prefix_len :])
        for j, node in enumerate(nodes):
            ctx = self.context(node)
            seen = {self.cache[col] for col in range(width) if mask[j, col]}
            # a token attends to its whole context (prefix + tree ancestors) and nothing else
            assert seen == {ctx[: i + 1] for i in range(len(ctx) - 1)}
            assert mask[j, width:].tolist() == [k == j for k in range(len(nodes))]
        assert tree.positions(nodes).tolist() == [len(self.context(n)) - 1 for n in nodes]
        tree.expand(nodes, dists, num_children=c, generator=gen)
        self.cache.extend(self.context(n) for n in nodes)  # the forward writes the new KV

    def reroot(self, verified: list[int]) -> None:
        tree = self.tree
        old_prefix, old_slots = tree.prefix_len, tree.n_slots
        old_contexts = {self.context(n) for n in range(len(tree))}
        walk = [0]
        for tok in verified:
            walk.append(tree.child_with_token(walk[-1], tok) if walk[-1] >= 0 else -1)
        expected_kept = (
            {self.context(n) for n in tree._subtree(walk[-1])} if walk[-1] >= 0 else None
        )
        as_tensor = torch.arange(len(self.cache), dtype=torch.float32).view(1, -1)

        new_history = self.history + [tree.root_token] + list(verified[:-1]) if verified else self.history
        plan = tree.reroot(verified)
        assert plan.old_prefix_len == old_prefix
        assert plan.new_prefix_len == old_prefix + len(verified) == len(new_history)
        # (a) every old slot goes exactly one way: prefix, kept, or freed
        moved = [s for s, _ in plan.to_prefix] + [s for s, _ in plan.keep] + list(plan.free)
        assert sorted(moved) == list(range(old_slots))
        assert [d for _, d in plan.keep] == list(range(len(plan.keep)))  # contiguous, no gaps
        assert [s for s, _ in plan.keep] == sorted(s for s, _ in plan.keep)  # order preserved
        prefix_positions = [pos for _, pos in plan.to_prefix] + list(plan.recompute)
        assert sorted(prefix_positions) == list(range(old_prefix, plan.new_prefix_len))
        new_cache: list[tuple[int, ...] | None] = self.cache[:old_prefix] + [None] * (
            plan.new_prefix_len - old_prefix + len(plan.keep)
        )
        for s, pos in plan.to_prefix:
            new_cache[pos] = self.cache[old_prefix + s]
        for pos in plan.recompute:  # the draft runs these tokens itself
            new_cache[pos] = tuple(new_history[: pos + 1])
        for s, d in plan.keep:
            new_cache[plan.new_prefix_len + d] = self.cache[old_prefix + s]
        # the reference tensor compaction moves the same entries
        as_tensor = torch.cat([as_tensor, torch.zeros(1, len(new_cache))], dim=1)
        plan.apply(as_tensor, seq_dim=1)
        for idx, entry in enumerate(new_cache):
            if idx not in plan.recompute:
                assert self.cache[int(as_tensor[0, idx])] == entry
        self.history, self.cache = new_history, new_cache
        assert plan.root_in_tree == (expected_kept is not None)
        new_contexts = {self.context(n) for n in range(len(tree))}
        if expected_kept is not None:
            assert new_contexts == expected_kept <= old_contexts  # exactly the surviving subtree
            assert plan.node_map[walk[-1]] == 0
        else:
            assert len(tree) == 1 and tree.root_token == verified[-1] and tree.n_slots == 0
        self.check_cache()

    def check_cache(self) -> None:
        tree = self.tree
        assert len(self.cache) == tree.prefix_len + tree.n_slots
        for i in range(tree.prefix_len):
            assert self.cache[i] == tuple(self.history[: i + 1])
        owners = sorted((tree.slots[n], n) for n in range(len(tree)) if tree.slots[n] >= 0)
        assert [s for s, _ in owners] == list(range(tree.n_slots))  # no duplicates, no gaps
        for s, node in owners:
            assert self.cache[tree.prefix_len + s] == self.context(node)


def check_tree(tree: DraftTree) -> None:
    n = len(tree)
    assert tree.parents[0] == -1 and tree.depths[0] == 0 and tree.weights[0] == 0.0
    for v in range(1, n):
        par = tree.parents[v]
        # (b) a tree rooted at 0, ids topologically ordered, children lists consistent
        assert 0 <= par < v and tree.depths[v] == tree.depths[par] + 1
        assert v in tree.children[par] and tree.is_expanded(par)
        # (c) cumulative log-probs are the sums along the path
        path = tree.path(v)[1:]
        assert math.isclose(tree.weights[v], sum(tree.values[u] for u in path), abs_tol=1e-9)
        assert math.isclose(tree.priorities[v], sum(tree.priors[u] for u in path), abs_tol=1e-9)
        q_par = tree.dists[par]
        assert math.isclose(tree.values[v], math.log(float(q_par[tree.tokens[v]])), rel_tol=1e-6)
        ranked = torch.sort(q_par, descending=True).values
        rank = tree.draw_index[v]
        assert math.isclose(tree.priors[v], math.log(float(ranked[rank])), rel_tol=1e-6, abs_tol=1e-7)
        if tree.mode == "topk":
            assert tree.priors[v] == tree.values[v]
    for v in range(n):
        kids = tree.children[v]
        assert list(kids) == sorted(kids)
        assert [tree.draw_index[k] for k in kids] == list(range(len(kids)))
        assert len({tree.tokens[k] for k in kids}) == len(kids)  # distinct tokens among siblings
        assert all(tree.priorities[a] >= tree.priorities[b] for a, b in zip(kids, kids[1:]))


def check_selection(tree: DraftTree, bs: int) -> None:
    batch = tree.select_subtree(bs)
    chosen = batch.node_ids
    # (d) size, root, connected with parents first, top-bs by key
    assert len(chosen) == min(bs, len(tree)) == len(set(chosen))
    assert chosen[0] == 0 and batch.parents[0] == -1
    for i in range(1, len(chosen)):
        assert 0 <= batch.parents[i] < i and chosen[batch.parents[i]] == tree.parents[chosen[i]]
    outside = [v for v in range(len(tree)) if v not in set(chosen)]
    if outside:
        assert max(tree.key(v) for v in chosen) < min(tree.key(v) for v in outside)
        if tree.mode == "topk":  # keys are the cumulative log-probs themselves
            assert min(tree.weights[v] for v in chosen) >= max(tree.weights[v] for v in outside)
    for i, kids in enumerate(batch.children):
        # the selected children of a node are the first ones it drew
        assert [batch.draw_index[k] for k in kids] == list(range(len(kids)))
        assert [chosen[k] for k in kids] == list(tree.children[chosen[i]][: len(kids)])
    # (e) ancestor mask and positions
    mask = batch.attention_mask
    assert mask.shape == (len(chosen), len(chosen))
    for i in range(len(chosen)):
        anc = set(tree.path(chosen[i]))
        assert mask[i].tolist() == [chosen[j] in anc for j in range(len(chosen))]
    assert batch.position_ids.tolist() == [tree.prefix_len + tree.depths[v] for v in chosen]
    assert batch.input_ids.tolist() == [tree.tokens[v] for v in chosen]


def check_frontier(tree: DraftTree, w: int) -> list[int]:
    leaves = tree.leaves_to_expand(w)
    unexpanded = sorted((v for v in range(len(tree)) if not tree.is_expanded(v)), key=tree.key)
    assert leaves == unexpanded[:w]
    return leaves


expand_op = st.tuples(st.just("expand"), st.integers(1, 4), st.integers(1, 4))
reroot_op = st.tuples(st.just("reroot"), st.lists(st.integers(0, 3), max_size=3), st.integers(0, 9))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["topk", "sample"]),
    vocab=st.integers(3, 7),
    top_k=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    ops=st.lists(st.one_of(expand_op, reroot_op), min_size=1, max_size=12),
    bs=st.integers(1, 9),
)
def test_tree_invariants_hold_under_any_expand_reroot_sequence(mode, vocab, top_k, seed, ops, bs):
    gen = torch.Generator().manual_seed(seed)
    history = [int(t) for t in torch.randint(vocab, (3,), generator=gen)]
    tree = DraftTree(root_token=int(torch.randint(vocab, (1,), generator=gen)), prefix_len=3, mode=mode)
    kv = KVModel(tree, history)
    for op in ops:
        if op[0] == "expand":
            _, w, c = op
            leaves = check_frontier(tree, w)
            if leaves:
                kv.expand(leaves, _dists(gen, len(leaves), vocab, top_k), c, gen)
        else:
            _, choices, bonus = op
            verified, node = [], 0
            for choice in choices:  # accepted tokens: a path down the tree
                if not tree.children[node]:
                    break
                node = tree.children[node][choice % len(tree.children[node])]
                verified.append(tree.tokens[node])
            verified.append(bonus % vocab)  # the target's own token: in the tree or not
            kv.reroot(verified)
        check_tree(tree)
        check_selection(tree, bs)
        kv.check_cache()


def test_topk_growth_is_maximum_likelihood():
    # root q: token 2 (0.5), 0 (0.3), 1 (0.2); after token 2: q = token 1 (0.9), token 0 (0.1)
    tree = DraftTree(root_token=7, prefix_len=4, mode="topk")
    tree.expand([0], torch.tensor([[0.3, 0.2, 0.5]]), num_children=3)
    assert [tree.tokens[c] for c in tree.children[0]] == [2, 0, 1]
    assert tree.leaves_to_expand(2) == [1, 2]
    tree.expand([1], torch.tensor([[0.1, 0.9, 0.0]]), num_children=3)  # zero mass: no child
    assert [tree.tokens[c] for c in tree.children[1]] == [1, 0]
    # weights: 2 -> log .5, 2/1 -> log .45, 0 -> log .3, 1 -> log .2, 2/0 -> log .05
    batch = tree.select_subtree(3)
    assert [tree.tokens[v] for v in batch.node_ids] == [7, 2, 1]
    assert batch.position_ids.tolist() == [4, 5, 6]
    assert tree.select_subtree(4).node_ids == [0, 1, 4, 2]
    assert tree.leaves_to_expand(1) == [4]
    assert math.isclose(tree.weights[4], math.log(0.45), rel_tol=1e-6)


def test_reroot_keeps_the_verified_subtree_and_packs_its_slots():
    # Figure 5 of SwiftSpec in small: verified path root -> a -> b, subtree of b kept
    tree = DraftTree(root_token=9, prefix_len=10, mode="topk")
    tree.expand([0], torch.tensor([[0.6, 0.4, 0.0, 0.0]]), num_children=2)  # slot 0: root
    a, other = tree.children[0]
    tree.expand([a, other], torch.tensor([[0.0, 0.0, 0.7, 0.3], [0.0, 0.0, 0.5, 0.5]]), 2)
    b = tree.children[a][0]
    tree.expand([b], torch.tensor([[0.5, 0.5, 0.0, 0.0]]), 2)  # slot 3: b
    tree.expand(tree.children[b][:1], torch.tensor([[0.25, 0.25, 0.25, 0.25]]), 1)  # slot 4
    plan = tree.reroot([tree.tokens[a], tree.tokens[b]])
    assert plan.to_prefix == ((0, 10), (1, 11)) and plan.recompute == ()
    assert plan.keep == ((3, 0), (4, 1)) and plan.free == (2,)
    assert plan.new_prefix_len == 12 and tree.prefix_len == 12 and plan.root_in_tree
    assert tree.tokens[0] == 2 and tree.n_slots == 2 and tree.depths[1] == 1
    assert tree.weights[0] == 0.0 and math.isclose(tree.weights[1], math.log(0.5), rel_tol=1e-6)
    # falling off the tree: fresh root, nothing kept, unexpanded verified tokens recomputed
    plan = tree.reroot([tree.tokens[tree.children[0][1]], 3])
    assert plan.to_prefix == ((0, 12),) and plan.recompute == (13,) and plan.keep == ()
    assert sorted(plan.free) == [1] and not plan.root_in_tree
    assert len(tree) == 1 and tree.root_token == 3 and tree.leaves_to_expand(4) == [0]


def test_sample_mode_draws_without_replacement_in_sequential_order():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    gen = torch.Generator().manual_seed(1)
    # expand many leaves with the same q at once: each draws 2 children without replacement
    tree = DraftTree(root_token=0, mode="sample")
    tree.expand([0], torch.full((1, n), 1.0 / n), num_children=n, generator=gen)
    roots = tree.children[0]
    tree.expand(roots, q.expand(n, 4), num_children=2, generator=gen)
    pairs = torch.tensor([[tree.tokens[c] for c in tree.children[r]] for r in roots])
    assert (pairs[:, 0] != pairs[:, 1]).all()
    first = torch.bincount(pairs[:, 0], minlength=4) / n
    assert (first - q).abs().sum() / 2 < 0.02
    # second draw given first = a: q without a, renormalized
    second = torch.zeros(4)
    for a in range(4):
        second += q[a] * torch.where(torch.arange(4) == a, 0.0, q / (1 - q[a]))
    emp_second = torch.bincount(pairs[:, 1], minlength=4) / n
    assert (emp_second - second).abs().sum() / 2 < 0.02
    # priorities follow the ranked probabilities, not the drawn tokens
    r = roots[0]
    assert [tree.priors[c] for c in tree.children[r]] == pytest.approx([math.log(0.5), math.log(0.3)])


def test_expanding_twice_or_empty_is_handled():
    tree = DraftTree(root_token=1)
    assert tree.expand([], torch.zeros(0, 3)) == []
    tree.expand([0], torch.tensor([[0.2, 0.3, 0.5]]))
    with pytest.raises(ValueError):
        tree.expand([0], torch.tensor([[0.2, 0.3, 0.5]]))
    with pytest.raises(ValueError):
        DraftTree(root_token=0, mode="beam")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tree.select_subtree(0)
    plan = tree.reroot([])
    assert plan.keep == ((0, 0),) and plan.new_prefix_len == 0 and len(tree) == 2
