"""The draft side of a token-tree schedule (SwiftSpec Algorithm 1, draft half), time-free.

Both backends drive the same ``TreeDrafter``: the simulator times each expansion with its cost
model (sim.oracle.tree_tokens.TimedTreeDrafter), a real backend runs a draft forward. What differs is
only where the draft's distributions come from, a ``DraftSource``.

API
---
``DraftSource`` (abstract; one per request) — where the draft's distributions come from:

- ``mode: TreeMode`` ("topk" at temperature 0, "sample" otherwise) and
  ``generator: torch.Generator | None`` (used by ``DraftTree.expand`` in sample mode);
- ``history() -> list[int]``: the committed tokens; the tree's root is the last one;
- ``draft_dists(tree, nodes) -> Tensor[len(nodes), V]``: the draft's next-token distribution
  after each node of ``nodes`` (node ids of ``tree``, in that order). A model-backed source runs
  its draft forward here: inputs = first the verified tokens whose KV it never computed (the
  prefix positions of the last ``compact`` plans' ``recompute``), then ``nodes`` at
  ``tree.positions(nodes)`` with ``tree.expansion_mask(nodes)``;
- ``commit(tokens)``: the target verified ``tokens`` (accepted ones, then its bonus token); called
  before the tree re-roots on them;
- ``compact(plan)``: the tree re-rooted; ``plan`` (a ``KVCompactionPlan``) says how the draft KV
  cache must be rearranged and which prefix positions must be recomputed. Default: nothing (an
  oracle has no cache).

``TreeDrafter(source, width=w, budget=bs, kv=None)`` — owns ``tree`` (a ``DraftTree`` rooted at
``source.history()[-1]``, prefix ``len(history) - 1``):

- ``expand() -> Expansion | None``: expands the ``width`` most probable unexpanded leaves, ``width``
  children each; None when nothing is left to expand. The returned ``Expansion`` is what the
  forward costs: ``leaves``, ``recompute`` (verified tokens fed first, count), ``context_len``
  (cache entries before the inputs: prefix + tree slots before the expansion), ``n_inputs``.
- ``fill() -> list[Expansion]``: expands until the tree holds at least ``budget`` nodes
  (Alg. 1 l. 15-16) or nothing is left.
- ``select() -> TreeBatch``: the most probable subtree of ``budget`` nodes, for the target.
- ``advance(tokens) -> KVCompactionPlan``: ``source.commit(tokens)``, re-root, ``source.compact``;
  the plan's ``recompute`` count is charged to the next expansion.
- ``summary_fields() -> dict``: ``tree_width``, ``tree_budget``, ``tree_kv_reuse`` (share of the
  tree KV slots kept by re-roots, over every drafter sharing ``kv``), ``draft_rows`` (the rows of
  ``rows``, a ``DraftRowSample``: written to the run's draft_rows.json, not to summary.json).

``async_depth(tree_depth=, t_target=, t_draft=) -> int`` — how many expansions the draft of
``schedule=async`` runs while the target verifies (SwiftSpec §3.2); both backends call it, the
simulator with modelled times, the real backend with times measured on its own devices.

``AsyncDepth(tree_depth=, t_target=, t_draft=, reply_s=)`` — d round by round: the first round's
from the probe's two times, every later round's from the times of the rounds done (``observe``:
the target's time for the last subtree, the last expansions' times). Both backends' draft
workers drive it, with modelled or measured times.

``TreeKvStats`` — ``kept`` / ``freed`` tree KV slots; pass one instance to every drafter of a run
to get the run's reuse ratio.

``DraftRowSample(capacity=256)`` — a uniform sample (reservoir) of the draft's ranked child
probabilities at the nodes it expanded below the root, over every drafter sharing it: each row the
w largest q of one node, in descending order. A replayed trace grows its trees from them
(sim.oracle.tree_tokens.TraceTreeTokens): the shape of the recorded draft's trees, not one α's.
"""

from __future__ import annotations

import math
import random
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from testbed.spec.tree import DraftTree
from testbed.spec.tree_io import KVCompactionPlan, TreeBatch, TreeMode


class DraftSource(ABC):
    """The draft's distributions on the tree of one request (see the module docstring)."""

    mode: TreeMode = "topk"
    generator: torch.Generator | None = None

    @abstractmethod
    def history(self) -> list[int]:
        """Committed tokens (the tree's root is the last)."""

    @abstractmethod
    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), V]: the draft's distribution after each node (for DraftTree.expand)."""

    @abstractmethod
    def commit(self, tokens: list[int]) -> None:
        """The draft learns the verified tokens (before it re-roots)."""

    def compact(self, plan: KVCompactionPlan) -> None:
        """The tree re-rooted: rearrange the draft KV cache by ``plan`` (oracles have none)."""
        del plan  # an oracle keeps no KV cache

    # a feature-level draft (EAGLE) reads the target's hidden states of the verified tokens
    reads_features: bool = False

    def verified_features(self, features: torch.Tensor | None) -> None:  # noqa: B027 - optional hook
        """The target's features of the old root and the accepted tokens ``[1 + accepted, dim]``,
        before ``commit`` (only where ``reads_features``)."""

    def new_tree(self) -> DraftTree:
        h = self.history()
        return DraftTree(root_token=h[-1], prefix_len=len(h) - 1, mode=self.mode)


@dataclass(frozen=True)
class Expansion:
    """One draft forward of tree growth: what it fed and over how much context."""

    leaves: list[int]  # node ids expanded (the forward's tree inputs)
    recompute: int  # verified tokens whose draft KV was never computed, fed first
    context_len: int  # cache entries before the inputs: prefix + tree slots

    @property
    def n_inputs(self) -> int:
        return len(self.leaves) + self.recompute


MAX_ASYNC_DEPTH = 64


def async_depth(*, tree_depth: int, t_target: float, t_draft: float) -> int:
    """``schedule.tree_depth`` when set; when 0, as SwiftSpec sets d: with t_target = one
    verification (target forward over bs tokens plus both link messages) and t_draft = one
    whole expansion (its forward and growing the tree), r = floor(t_target / t_draft) and d = r or r+1, whichever makes the d
    expansions end closest to the verification (d = floor(t_target / t_draft + 1/2)), at
    least 1 and at most ``MAX_ASYNC_DEPTH``."""
    if tree_depth > 0:
        return tree_depth
    ratio = t_target / t_draft if t_draft > 0 else float(MAX_ASYNC_DEPTH)
    return min(MAX_ASYNC_DEPTH, max(1, math.floor(ratio + 0.5)))


class AsyncDepth:
    """d of every round of ``schedule=async`` with ``schedule.tree_depth=0``: ``async_depth`` of
    the median target time of the last ``TARGET_WINDOW`` rounds and the median time of the last
    ``DRAFT_WINDOW`` expansions; the probe's two times only for the first round.

    Why not the probe's d throughout: the probe times expansions of a tree grown at one point
    of one request, alone. What the draft does while the target verifies differs: an n-gram's
    expansions have 1 to w leaves depending on the text (the probe's tree, grown on copies of
    one token, has one: d came out at its cap of 64 where a round's expansions then took ~1.5
    ms each against a ~65 ms verification, and the rounds after a full one ran 25-45 % long),
    and both groups slow each other down. A round's own times measure all of that.

    ``observe`` takes the target's time for the last subtree as the draft sees it: from its
    sending the subtree to the target's sending the verified tokens (``target_span``: the
    subtree's transfer, the verification, the bookkeeping), plus the reply's one-way time
    ``reply_s`` — the same quantity as the probe's t_target (a verification plus both
    messages). With ``tree_depth`` > 0, d is that and never changes."""

    TARGET_WINDOW = 8  # rounds
    DRAFT_WINDOW = 32  # expansions (a few rounds' worth)

    def __init__(self, *, tree_depth: int, t_target: float, t_draft: float, reply_s: float) -> None:
        self.fixed, self.reply_s = tree_depth, reply_s
        self.depth = async_depth(tree_depth=tree_depth, t_target=t_target, t_draft=t_draft)
        self.first = self.depth
        self._targets: deque[float] = deque(maxlen=self.TARGET_WINDOW)
        self._drafts: deque[float] = deque(maxlen=self.DRAFT_WINDOW)
        self._used: list[int] = []

    @classmethod
    def constant(cls, depth: int) -> AsyncDepth:
        """d = ``depth`` (0 allowed: no growth while the target verifies) in every round."""
        ctl = cls(tree_depth=1, t_target=0.0, t_draft=0.0, reply_s=0.0)
        ctl.depth = ctl.first = depth
        return ctl

    @property
    def adaptive(self) -> bool:
        return self.fixed <= 0

    def next_round(self) -> int:
        """d for the round about to be drafted (recorded for ``summary_fields``)."""
        self._used.append(self.depth)
        return self.depth

    def observe(self, *, target_span: float | None, expansions: Iterable[float]) -> int:
        """Fold in one round's times (``target_span`` None: not known, e.g. the last round);
        returns d for the next round."""
        if not self.adaptive:
            return self.depth
        self._drafts.extend(expansions)
        if target_span is not None and math.isfinite(target_span):
            self._targets.append(target_span + self.reply_s)
        if self._targets and self._drafts:
            self.depth = async_depth(tree_depth=0, t_target=statistics.median(self._targets),
                                     t_draft=statistics.median(self._drafts))
        return self.depth

    def summary_fields(self) -> dict[str, float]:
        """``tree_depth_used``: the first round's d (the probe's); ``tree_depth_mean`` /
        ``_min`` / ``_max`` over every round drafted."""
        used = self._used or [self.depth]
        return {"tree_depth_used": self.first, "tree_depth_mean": sum(used) / len(used),
                "tree_depth_min": min(used), "tree_depth_max": max(used)}


@dataclass
class TreeKvStats:
    """Tree KV slots kept (moved to the prefix or the new tree) and dropped by re-roots."""

    kept: int = 0
    freed: int = 0

    @property
    def reuse(self) -> float | None:
        moved = self.kept + self.freed
        return self.kept / moved if moved else None


@dataclass
class DraftRowSample:
    """The draft's ranked child probabilities at expanded non-root nodes, a uniform sample of at
    most ``capacity`` rows over a run (reservoir sampling, seeded: the same run keeps the same
    rows). Why: a tree's depth is set by how the draft's mass spreads over its candidates — an
    n-gram draft puts all of it on one continuation at most nodes and grows chains, a model draft
    spreads it — and a replay that grows its trees from one geometric α row builds batches too
    shallow for the deep acceptances an n-gram run records. The root is left out: whether it has
    a continuation is replayed round by round (a round that drafted nothing)."""

    capacity: int = 256
    seen: int = 0
    rows: list[list[float]] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def offer(self, tree: DraftTree, nodes: list[int], dists: torch.Tensor, width: int) -> None:
        """Consider the rows ``dists`` of the expanded ``nodes`` (ranked only when kept: a top-k
        over the vocabulary costs ~20 µs, and after the first ``capacity`` rows few are)."""
        for j, node in enumerate(nodes):
            if tree.depths[node] == 0:
                continue
            self.seen += 1
            slot = len(self.rows) if len(self.rows) < self.capacity else self.rng.randrange(self.seen)
            if slot >= self.capacity:
                continue
            k = min(width, dists.shape[-1])
            row = [round(float(v), 6) for v in torch.topk(dists[j].float(), k).values.tolist()]
            if slot == len(self.rows):
                self.rows.append(row)
            else:
                self.rows[slot] = row


class TreeDrafter:
    """One request's DraftTree grown by maximum likelihood from a DraftSource."""

    def __init__(self, source: DraftSource, *, width: int, budget: int,
                 kv: TreeKvStats | None = None, rows: DraftRowSample | None = None) -> None:
        self.source = source
        self.width, self.budget = width, budget
        self.tree = source.new_tree()
        self.recompute = 0  # verified tokens whose draft KV was never computed (fed next forward)
        self.kv = kv if kv is not None else TreeKvStats()
        self.rows = rows if rows is not None else DraftRowSample()

    def expand(self) -> Expansion | None:
        """Expand the w most probable leaves, w children each (None: nothing to expand)."""
        tree = self.tree
        leaves = tree.leaves_to_expand(self.width)
        if not leaves:
            return None
        step = Expansion(leaves, self.recompute, tree.prefix_len + tree.n_slots)
        self.recompute = 0
        dists = self.source.draft_dists(tree, leaves)
        self.rows.offer(tree, leaves, dists, self.width)
        tree.expand(leaves, dists, num_children=self.width, generator=self.source.generator)
        return step

    def fill(self) -> list[Expansion]:
        """Expand until the tree holds at least `budget` nodes (SwiftSpec Alg. 1 l. 15-16)."""
        steps: list[Expansion] = []
        while len(self.tree) < self.budget:
            step = self.expand()
            if step is None:
                break
            steps.append(step)
        return steps

    def select(self) -> TreeBatch:
        """The most probable subtree of `budget` nodes (closed under parent), for the target."""
        return self.tree.select_subtree(self.budget)

    def advance(self, tokens: list[int], *, features: torch.Tensor | None = None) -> KVCompactionPlan:
        """Commit the verified tokens and re-root (KV compaction plan from DraftTree);
        ``features``: the target's of the old root and the accepted tokens, for a source that
        reads them."""
        if self.source.reads_features:
            self.source.verified_features(features)
        self.source.commit(tokens)
        plan = self.tree.reroot(tokens)
        self.source.compact(plan)
        self.recompute += len(plan.recompute)
        self.kv.kept += len(plan.keep) + len(plan.to_prefix)
        self.kv.freed += len(plan.free)
        return plan

    def summary_fields(self) -> dict[str, float | None]:
        return {"tree_width": self.width, "tree_budget": self.budget,
                "tree_kv_reuse": self.kv.reuse, "draft_rows": self.rows.rows}
