"""Token sources for draft trees in the simulator (`sync_tree`, `async`).

The tree itself (growth, selection, re-rooting, KV plan) is ``testbed.spec.tree.DraftTree`` and
the verification ``testbed.spec.tree_verify``; this module only says where the draft's and the
target's distributions come from, per request:

``acceptance=synthetic`` — ``SyntheticLM`` (sim.oracle.base) on the tree paths: a node's draft q is
the draft distribution after (the committed tokens, the node's path); the target's p at every
verified node likewise. At temperature 0 the tree is grown in ``topk`` mode ranked by the draft's
softmax at temperature 1 (the standardized q is one-hot and would make every tree a chain;
SwiftSpec ranks by the softmax log-probabilities) and verified greedily: the output is exactly
greedy `ar`. At temperature > 0 the tree is grown in ``sample`` mode from the standardized q (the
proposal the lossless multi-candidate rule needs) and verified by ``verify_sampled``.

``acceptance=iid`` — a *rank model* with no token ids. The draft's children of every node are
its ranks 0, 1, 2, … with probabilities α(1−α)^j (a calibrated draft); at every verified node
the target's token has draft rank J ~ Geometric(α): P(J = j) = α(1−α)^j, independent across
nodes. The target accepts the batch child of rank J if it was sent, otherwise J is the bonus
token (still a tree node when J < tree_width, so re-rooting keeps its subtree). A chain (one
child per node) is therefore accepted token by token with probability α — Leviathan's i.i.d.
model — and a node verified with its m best children accepts with 1 − (1−α)^m.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sim.oracle.base import IidOracle
from sim.oracle.synthetic import SyntheticSequence
from sim.runtime.context import SimContext, SimRequest
from testbed.spec.ngram import NgramTreeSource
from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import (
    DraftRowSample,
    DraftSource,
    Expansion,
    TreeDrafter,
    TreeKvStats,
)
from testbed.spec.tree_io import TreeBatch
from testbed.spec.tree_verify import verify_tree

Keys = list[tuple[int, int]]


@dataclass
class TreeOutcome:
    tokens: list[int]  # accepted tokens, then the target's own token (the bonus)
    accepted: int
    checked: int  # accepted + 1 when the stop node had candidates that were all rejected


class TreeTokens(DraftSource):
    """Draft and target distributions on the tree of one request (the draft side is the
    DraftSource interface of testbed.spec.tree_drafter)."""

    def target_keys(self, tree: DraftTree, batch: TreeBatch) -> Keys:
        """What the target needs to know about the batch's contexts, fixed when it is sent."""
        return []

    @abstractmethod
    def verify(self, batch: TreeBatch, keys: Keys) -> TreeOutcome: ...


def _checked(batch: TreeBatch, accepted_nodes: list[int]) -> int:
    """Accepted guesses plus one when the walk stopped at a node whose candidates all failed."""
    stop = batch.node_ids.index(accepted_nodes[-1]) if accepted_nodes else 0
    return len(accepted_nodes) + (1 if batch.children[stop] else 0)


class SyntheticTreeTokens(TreeTokens):
    def __init__(self, seq: SyntheticSequence) -> None:
        self.seq, self.lm = seq, seq.lm
        self.greedy = seq.lm.params.greedy
        self.mode = "topk" if self.greedy else "sample"
        self.generator = seq.gen
        self._rank_cache: dict[tuple[int, int], torch.Tensor] = {}

    def history(self) -> list[int]:
        return self.seq.tokens

    def _key(self, tree: DraftTree, node: int) -> tuple[int, int]:
        """The synthetic LM is a bigram model: the last two tokens of the node's context."""
        if tree.depths[node] == 0:
            h = self.seq.tokens
            return h[-2], h[-1]
        parent = tree.parents[node]
        return tree.tokens[parent], tree.tokens[node]

    def _ranking(self, key: tuple[int, int]) -> torch.Tensor:
        q = self._rank_cache.get(key)
        if q is None:
            if len(self._rank_cache) > 65536:
                self._rank_cache.clear()
            d = self.lm.logits(*key)[1].float()
            e = torch.exp(d - d.max())  # softmax by hand: torch.softmax threads on tiny inputs
            q = self._rank_cache[key] = e / e.sum()
        return q

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        keys = [self._key(tree, n) for n in nodes]
        if self.greedy:
            return torch.stack([self._ranking(k) for k in keys])
        return torch.stack([self.lm.dists(k)[1] for k in keys])

    def target_keys(self, tree: DraftTree, batch: TreeBatch) -> Keys:
        return [self._key(tree, n) for n in batch.node_ids]

    def verify(self, batch: TreeBatch, keys: Keys) -> TreeOutcome:
        p = torch.stack([self.lm.dists(k)[0] for k in keys])
        res = verify_tree(batch, p, self.greedy, self.generator)
        return TreeOutcome(res.tokens, res.accepted, _checked(batch, res.accepted_nodes))

    def commit(self, tokens: list[int]) -> None:
        self.seq.tokens.extend(tokens)


class NgramSyntheticTreeTokens(SyntheticTreeTokens):
    """``pair.draft.kind=ngram`` with ``acceptance=synthetic``: the draft's distributions are
    prompt lookup over the synthetic sequence (testbed.spec.ngram, the real backend's n-gram
    tree draft), the target's are the synthetic LM's."""

    def __init__(self, seq: SyntheticSequence, ngram: int) -> None:
        super().__init__(seq)
        self.ngram_source = NgramTreeSource(seq.tokens, ngram=ngram, vocab=seq.lm.vocab,
                                            mode=self.mode, generator=seq.gen)

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        return self.ngram_source.draft_dists(tree, nodes)


class IidTreeTokens(TreeTokens):
    """The rank model of the module docstring; tokens are draft ranks, ids are not produced."""

    def __init__(self, alpha: float, width: int, rng: random.Random) -> None:
        self.alpha, self.width, self.rng = alpha, width, rng
        self.row = torch.tensor([alpha * (1.0 - alpha) ** j for j in range(width)])
        self._log_miss = math.log1p(-alpha) if alpha > 0 else 0.0
        self._len = 2  # committed length (ids are meaningless; only the count matters)

    def history(self) -> list[int]:
        return [-1] * self._len  # the root token is never matched against a child

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        return self.row.expand(len(nodes), self.width)

    def rank(self) -> int:
        """J ~ Geometric(α) on {0, 1, ...} by inversion; α = 0 never matches."""
        if self.alpha <= 0.0:
            return self.width
        u = self.rng.random()
        return int(math.log1p(-u) / self._log_miss) if u > 0.0 else 0

    def verify(self, batch: TreeBatch, keys: Keys) -> TreeOutcome:
        node, accepted, tokens = 0, [], []
        while True:
            j = self.rank()
            nxt = next((c for c in batch.children[node] if batch.tokens[c] == j), -1)
            if nxt < 0:
                tokens.append(j)
                break
            node = nxt
            accepted.append(batch.node_ids[node])
            tokens.append(j)
        return TreeOutcome(tokens, len(accepted), _checked(batch, accepted))

    def commit(self, tokens: list[int]) -> None:
        self._len += len(tokens)


class TraceTreeTokens(IidTreeTokens):
    """``acceptance=trace`` (sim/oracle/trace.py): the rank model's tree, whose verifications
    accept what a recorded tree request's rounds accepted (serial tree or `async`), in order
    (wrapping around). A round that accepted n walks n steps down the batch: along the most
    probable children (rank 0: the first path a top-k tree grows and selects) while they lead
    deep enough, else down the deepest branch (the recording accepted n somewhere in a batch of
    the same size; the rank model's batch is shaped by one α, not by the draft's own
    confidence), fewer only where the batch is shallower than n. The bonus is the target's
    token at the stop node: a draft rank drawn from the rank model among the ranks that node's
    batch children do not hold — a child of the draft's tree beyond the batch keeps its subtree
    through the re-root, as the real draft's does. (A fresh bonus every round threw `async`'s
    subtree away: every batch was the root and its first children, no round accepted more
    than one token, and tokens per verification came out 12 % under the trace replayed.)

    A recorded round that drafted nothing (an n-gram draft that found no continuation: in
    validate's async n-gram runs 40-66 % of the rounds) is replayed as such: the round before
    it ends on a bonus that is no draft candidate (a fresh root, as the real tree had none of
    its continuation) and the draft gives that root no children, so the target verifies the
    root alone, a one-token forward. (The rank model alone filled every batch to bs, and the
    simulated target's forward averaged 63 ms where the real one took 47.)

    When the recorded run kept its draft's ranked rows (``rows``: draft_rows.json,
    testbed.spec.tree_drafter.DraftRowSample), every node's children get the probabilities of a
    row drawn from them, not the geometric α row: the tree has the recorded draft's shape. An
    n-gram draft puts all its mass on one continuation at most nodes, so its trees are chains
    and its rounds accept up to bs − 1 tokens; grown from α ≈ 0.4 the batches were two or three
    levels deep, and the replay of validate's async n-gram runs at temperature 0 accepted 12-14 %
    fewer tokens per round than the very rounds it replayed. A root is drawn among the rows with
    mass (whether it has any is the recorded round's ``drafted``)."""

    def __init__(self, accepted: list[int], match_rate: float, width: int, rng: random.Random, *,
                 drafted: list[int] | None = None, rows: list[list[float]] | None = None) -> None:
        super().__init__(min(max(match_rate, 1e-3), 1.0 - 1e-3), width, rng)
        self.accepted, self.next_round = accepted, 0
        self.drafted = drafted if drafted and len(drafted) == len(accepted) else None
        # one tensor per request (a prediction interval replays every request ~200 times)
        fitted = [(list(r[:width]) + [0.0] * width)[:width] for r in rows or []]
        self.rows = torch.tensor(fitted) if fitted else None
        self.with_mass = [i for i, r in enumerate(fitted) if r[0] > 0.0]

    def _recorded_row(self, root: bool) -> torch.Tensor:
        assert self.rows is not None
        if root and not self.with_mass:
            return self.row
        pick = self.rng.choice(self.with_mass) if root else self.rng.randrange(len(self.rows))
        return self.rows[pick]

    def barren(self, round_idx: int) -> bool:
        """Whether recorded round ``round_idx`` (wrapping around) drafted nothing."""
        return self.drafted is not None and self.drafted[round_idx % len(self.drafted)] == 0

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        if self.rows is not None:
            rows = torch.stack([self._recorded_row(tree.depths[n] == 0) for n in nodes])
        else:
            rows = super().draft_dists(tree, nodes)
        if self.barren(self.next_round) and any(tree.depths[n] == 0 for n in nodes):
            # the root of the round to be verified next has no continuation: no children
            rows = rows.clone()
            rows[[j for j, n in enumerate(nodes) if tree.depths[n] == 0]] = 0.0
        return rows

    def verify(self, batch: TreeBatch, keys: Keys) -> TreeOutcome:
        want = self.accepted[self.next_round % len(self.accepted)] if self.accepted else 0
        self.next_round += 1
        height = _heights(batch)
        node, accepted, tokens = 0, [], []
        while len(accepted) < want and batch.children[node]:
            need = want - len(accepted) - 1  # levels still needed below the next node
            kids = batch.children[node]
            nxt = next((c for c in kids if batch.tokens[c] == 0 and height[c] >= need), -1)
            if nxt < 0:
                nxt = max(kids, key=lambda c: (height[c], -batch.tokens[c]))
            node = nxt
            accepted.append(batch.node_ids[node])
            tokens.append(batch.tokens[node])
        fresh = self.barren(self.next_round)  # the next round's root is no draft candidate
        tokens.append(self.width if fresh else self._bonus({batch.tokens[c] for c in batch.children[node]}))
        return TreeOutcome(tokens, len(accepted), _checked(batch, accepted))

    def _bonus(self, taken: set[int]) -> int:
        """The target's token at the stop node: rank J ~ Geometric(α) given that J is none of
        the batch's children there (``width`` and above: not a draft candidate)."""
        if len(taken) >= self.width:
            return self.width
        for _ in range(64):
            j = self.rank()
            if j not in taken:
                return min(j, self.width)
        return self.width


def _heights(batch: TreeBatch) -> list[int]:
    """Per batch node, the levels below it in the batch (0 for a leaf); parents precede children."""
    height = [0] * len(batch.node_ids)
    for i in range(len(batch.node_ids) - 1, 0, -1):
        p = batch.parents[i]
        height[p] = max(height[p], height[i] + 1)
    return height


def tree_tokens(ctx: SimContext, req: SimRequest) -> TreeTokens:
    oracle = ctx.oracle
    if isinstance(oracle, IidOracle):
        return IidTreeTokens(oracle.alpha, ctx.exp.schedule.tree_width, oracle.rng)
    from sim.oracle.trace import TraceOracle

    if isinstance(oracle, TraceOracle):
        trace = oracle.traces[req.request_id % len(oracle.traces)]
        return TraceTreeTokens([n for _, n in trace.rounds], trace.match_rate, ctx.exp.schedule.tree_width,
                               random.Random(1_000_003 * oracle.seed + req.request_id),
                               drafted=[d for d, _ in trace.rounds], rows=trace.draft_rows)
    seq = oracle.sequence(req.request_id, req.prompt_len)
    if isinstance(seq, SyntheticSequence):
        d = ctx.exp.pair.draft
        return NgramSyntheticTreeTokens(seq, d.ngram) if d.kind == "ngram" else SyntheticTreeTokens(seq)
    raise ValueError(f"acceptance={ctx.exp.acceptance.oracle}: token trees need acceptance=iid, "
                     "synthetic or trace")


def batched_expansion_seconds(cost: Any, steps: Sequence[Expansion]) -> float:
    """One tree-masked draft forward expanding ``steps`` (one per request, each over its own
    tree) and the rest of growing each tree (leaves picked, children added)."""
    return cost.batch_forward("draft", [(st.n_inputs, st.context_len) for st in steps], tree=True) \
        + sum(cost.tree_expand_extra(len(st.leaves)) for st in steps)


class TimedTreeDrafter:
    """The draft side of a tree schedule: testbed's TreeDrafter, expansions timed by the cost
    model."""

    def __init__(self, ctx: SimContext, toks: TreeTokens) -> None:
        s = ctx.exp.schedule
        self.ctx, self.toks = ctx, toks
        # tree KV slots kept / dropped by re-roots, over the whole run
        kv = ctx.state.setdefault("tree_kv", TreeKvStats())
        rows = ctx.state.setdefault("tree_rows", DraftRowSample())
        self.core = TreeDrafter(toks, width=s.tree_width, budget=s.tree_budget, kv=kv, rows=rows)
        self.width, self.budget = self.core.width, self.core.budget

    @property
    def tree(self) -> DraftTree:
        return self.core.tree

    def _seconds(self, step: Expansion) -> float:
        return batched_expansion_seconds(self.ctx.cost, [step])

    def expand(self) -> float | None:
        """Expand the w most probable leaves; returns the forward's seconds (None: nothing
        left to expand). The tree changes now; the caller lets the time pass."""
        step = self.core.expand()
        return None if step is None else self._seconds(step)

    def fill(self) -> float:
        """Expand until the tree holds at least `budget` nodes; returns the seconds."""
        total = 0.0
        for step in self.core.fill():
            total += self._seconds(step)
        return total

    def select(self) -> tuple[TreeBatch, Keys]:
        batch = self.core.select()
        return batch, self.toks.target_keys(self.tree, batch)

    def advance(self, tokens: list[int]) -> None:
        self.core.advance(tokens)

    def summary_fields(self) -> dict[str, float | None]:
        return self.core.summary_fields()


