"""Tree verification: exact greedy decoding at temperature 0, the target's law at temperature > 0.

Statistical tests run the whole SwiftSpec loop (grow by maximum likelihood, select a top-bs
subtree that leaves some drawn children out, verify, re-root and go on) on a procedural
target/draft pair and compare the law of the first emitted token, and of the first two jointly,
with the exact target law in total variation. Deliberately wrong rules (monkeypatched into the
same code) must land above the same tolerance.
"""

from __future__ import annotations

import heapq

import pytest
import torch

import testbed.spec.tree_verify as tree_verify
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree import DraftTree
from testbed.spec.tree_verify import verify_greedy, verify_sampled, verify_tree
from tests.helpers.spec_oracle import TokenOracle, single_thread, tv_distance


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


DRAWS = 20_000
TV_FIRST = 0.02  # sampling noise at 20k draws over <= 8 outcomes is about 0.007
TV_PAIR = 0.04  # ... and about 0.02 over the <= 64 outcomes of two tokens

FAMILIES = {
    "t1.0": TokenOracle(vocab=6, seed=11),
    "t0.7-topk4": TokenOracle(
        vocab=8, seed=12, target=SamplingParams(0.7, top_k=4), draft=SamplingParams(0.7, top_k=4),
        draft_noise=1.5,
    ),
    "t1.3-topp0.8": TokenOracle(
        vocab=5, seed=13, target=SamplingParams(1.3, top_p=0.8), draft=SamplingParams(1.0, top_p=0.9)
    ),
    "part-disjoint": TokenOracle(vocab=6, seed=14, target_support=(0, 1, 2, 3), draft_support=(2, 3, 4, 5)),
    "sharp-draft": TokenOracle(vocab=6, seed=15, target=SamplingParams(1.5), draft=SamplingParams(0.4)),
}


def grow(tree: DraftTree, oracle: TokenOracle, history: tuple[int, ...], gen, expansions=1, w=2, c=2):
    """SwiftSpec's draft side: expand the root if needed, then ``expansions`` times the w best
    leaves; q at a node is the draft's law after its context."""
    for step in range(expansions + (not tree.is_expanded(0))):
        leaves = [0] if step == 0 and not tree.is_expanded(0) else tree.leaves_to_expand(w)
        dists = torch.stack([oracle.q(history + tuple(tree.path_tokens(n))) for n in leaves])
        tree.expand(leaves, dists, num_children=3 if leaves == [0] else c, generator=gen)


def decode(oracle, mode, n_tokens, gen, greedy=False, bs=5, root=0, tree_cls=DraftTree):
    """Emit at least ``n_tokens`` tokens after ``root`` with tree rounds; returns them all."""
    tree = tree_cls(root_token=root, prefix_len=0, mode=mode)
    history: tuple[int, ...] = ()  # verified tokens before the root
    emitted: list[int] = []
    while len(emitted) < n_tokens:
        grow(tree, oracle, history, gen)
        batch = tree.select_subtree(bs)
        p = torch.stack([oracle.p(history + tuple(tree.path_tokens(n))) for n in batch.node_ids])
        result = verify_tree(batch, p, greedy=greedy, generator=gen)
        assert [tree.tokens[n] for n in result.accepted_nodes] == result.tokens[:-1]
        history = history + (tree.root_token,) + tuple(result.tokens[:-1])
        emitted += result.tokens
        tree.reroot(result.tokens)
    return emitted


def measure_tv(oracle, mode, draws=DRAWS, seed=0, tree_cls=DraftTree):
    gen = torch.Generator().manual_seed(seed)
    pairs = [tuple(decode(oracle, mode, 2, gen, tree_cls=tree_cls)[:2]) for _ in range(draws)]
    tv_first = tv_distance([pr[:1] for pr in pairs], oracle.exact_first((0,)))
    tv_pair = tv_distance(pairs, oracle.exact_pair((0,)))
    return tv_first, tv_pair


@pytest.mark.parametrize(
    ("family", "mode", "draws"),
    # part-disjoint: 12k draws (rejections make its trials twice as long), 16 live pairs.
    # t1.0 is slow: by default part-disjoint samples at temperature 1 here, and the real
    # backend's serial tree and async (test_real_tree, test_real_async) check that law
    [pytest.param("t1.0", "sample", DRAWS, marks=pytest.mark.slow), ("part-disjoint", "sample", 12_000),
     ("t0.7-topk4", "topk", DRAWS)],
)
def test_tree_rounds_reproduce_the_target_law(family, mode, draws):
    tv_first, tv_pair = measure_tv(FAMILIES[family], mode, draws=draws)
    assert tv_first < TV_FIRST and tv_pair < TV_PAIR, (tv_first, tv_pair)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sample", "topk"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tree_rounds_reproduce_the_target_law_all_families(family, mode):
    tv_first, tv_pair = measure_tv(FAMILIES[family], mode, seed=1)
    assert tv_first < TV_FIRST and tv_pair < TV_PAIR, (tv_first, tv_pair)


CONTROL_DRAWS = 5_000  # the wrong rules below miss by 0.1-0.3, far beyond sampling noise


def test_negative_control_without_residual_update_fails(monkeypatch):
    # after a rejection the next child and the final token are judged against p itself
    monkeypatch.setattr(tree_verify, "residual", lambda p, q: p)
    tv_first, tv_pair = measure_tv(FAMILIES["sharp-draft"], "sample", draws=CONTROL_DRAWS)
    assert tv_first > TV_FIRST and tv_pair > TV_PAIR, (tv_first, tv_pair)


def test_negative_control_with_replacement_proposal_fails(monkeypatch):
    # children drawn without replacement but judged as if every draw came from the full q
    monkeypatch.setattr(tree_verify, "_without", lambda q, token: q)
    tv_first, tv_pair = measure_tv(FAMILIES["sharp-draft"], "sample", draws=CONTROL_DRAWS)
    assert tv_first > TV_FIRST and tv_pair > TV_PAIR, (tv_first, tv_pair)


class ValueShapedTree(DraftTree):
    """WRONG on purpose: a sample-mode tree whose growth and selection follow the log-probs of
    the tokens actually drawn (as topk mode does), offering the selected draws in draw order."""

    def expand(self, node_ids, dists, num_children=None, generator=None):
        new = super().expand(node_ids, dists, num_children, generator)
        for v in new:
            self.priors[v] = self.values[v]
            self.priorities[v] = self.priorities[self.parents[v]] + self.values[v]
        self._frontier = [(-self.priorities[v], v) for v in range(len(self)) if self.slots[v] < 0]
        heapq.heapify(self._frontier)
        return new

    def select_subtree(self, bs):
        batch = super().select_subtree(bs)
        for kids in batch.children:  # pretend the selected draws were the first ones
            for rank, kid in enumerate(kids):
                batch.draw_index[kid] = rank
        return batch


def test_negative_control_value_shaped_sample_tree_fails():
    # why sample-mode shapes use ranked probabilities: selecting draws by their own probability
    # biases which tokens get offered
    tv_first, tv_pair = measure_tv(FAMILIES["t1.0"], "sample", draws=CONTROL_DRAWS, tree_cls=ValueShapedTree)
    assert tv_first > TV_FIRST and tv_pair > TV_PAIR, (tv_first, tv_pair)


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_greedy_tree_decoding_is_autoregressive_greedy(mode):
    for seed in range(20):
        oracle = TokenOracle(vocab=7, seed=100 + seed, target=SamplingParams(0.0), draft_noise=1.0)
        gen = torch.Generator().manual_seed(seed)
        out = decode(oracle, mode, 12, gen, greedy=True)
        ctx, ar = (0,), []
        for _ in range(len(out)):
            ar.append(int(oracle.p(ctx).argmax()))
            ctx += (ar[-1],)
        assert out == ar


def _small_tree(mode: str) -> DraftTree:
    tree = DraftTree(root_token=0, mode=mode)
    gen = torch.Generator().manual_seed(0)
    tree.expand([0], torch.tensor([[0.1, 0.5, 0.4, 0.0]]), num_children=2, generator=gen)
    kids = tree.children[0]
    tree.expand(kids, torch.tensor([[0.0, 0.2, 0.8, 0.0], [0.3, 0.3, 0.2, 0.2]]), 2, generator=gen)
    return tree


def test_greedy_follows_the_target_argmax_and_stops_with_a_bonus():
    tree = _small_tree("topk")  # root -> {1, 2}; 1 -> {2, 1}; 2 -> {0, 1}
    batch = tree.select_subtree(7)
    p = torch.zeros(len(batch), 4)
    at = {tuple(tree.path_tokens(n)): i for i, n in enumerate(batch.node_ids)}
    p[at[(0,)], 1] = 1.0  # target wants 1: in the tree
    p[at[(0, 1)], 1] = 1.0  # then 1: in the tree
    p[at[(0, 1, 1)], 3] = 1.0  # a leaf: its argmax is the bonus
    result = verify_greedy(batch, p)
    assert result.tokens == [1, 1, 3] and result.accepted == 2
    assert [tree.tokens[n] for n in result.accepted_nodes] == [1, 1]
    # the sampling rule with one-hot targets takes the same path
    assert verify_sampled(batch, p, torch.Generator().manual_seed(3)).tokens == [1, 1, 3]
    p[at[(0,)]] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert verify_greedy(batch, p).tokens == [3]


def test_sampled_verification_rejects_a_batch_that_skips_a_draw():
    tree = _small_tree("sample")
    batch = tree.select_subtree(7)
    root_kids = batch.children[0]
    batch.children[0] = root_kids[1:]  # offer the second draw without the first
    p = torch.full((len(batch), 4), 0.25)
    with pytest.raises(ValueError, match="prefix"):
        verify_sampled(batch, p)
