"""The draft token tree of SwiftSpec (seed 002, §3.1–3.2), backend-neutral.

Layout. The root is the last verified token, at position ``prefix_len`` (the verified tokens
before it form the *prefix*); a node at depth d sits at position ``prefix_len + d``. A node gets
its KV state and its draft distribution q when it is *expanded* (it is an input of a draft
forward); its KV then lives in a *tree slot*: slot s is cache index ``prefix_len + s`` of the
draft's KV cache, i.e. slots are indexed from the end of the prefix cache, in expansion order.

Growth (maximum likelihood, SwiftSpec Algorithm 1). Every node has a *priority*, the sum along
its path of a per-node log-probability; ``leaves_to_expand(w)`` returns the w unexpanded nodes
of highest priority (a heap) and ``expand`` adds up to c children per node:

- ``mode="topk"``: the children are the c most probable tokens of q, priority = the cumulative
  draft log-prob (SwiftSpec's *weight*). Deterministic.
- ``mode="sample"``: the children are c draws *without replacement* from q, in draw order; the
  i-th child's priority increment is log of the i-th largest probability of q — what topk mode
  would give the i-th child — so the tree *shape* never depends on which tokens were drawn.
  That is what keeps tree verification at temperature > 0 lossless (tree_verify.py).

Order. The total order used everywhere is the *key* ``(-priority, node id)``; ids grow with
creation, so a child's key is larger than its parent's and a later-drawn sibling's key is larger
than an earlier one's. Hence the top-``bs`` nodes by key (``select_subtree``) are closed under
parent and contain, at every node, a prefix of its children in draw order.

Re-rooting (§3.2, Fig. 5). ``reroot(verified_tokens)`` walks down along the tokens emitted by the
target, moves the verified path into the prefix, keeps the subtree of the last verified token
(if it is in the tree) and returns the ``KVCompactionPlan`` that makes the draft KV cache match.

One round, as a backend drives it (tensors built here are on the CPU; move them as needed)::

    for _ in range(d):
        leaves = tree.leaves_to_expand(w)          # draft forward on these leaves with
        q = ...                                    # tree.expansion_mask(leaves), tree.positions(leaves)
        tree.expand(leaves, q, num_children=c, generator=g)
    batch = tree.select_subtree(bs)                # target forward: batch.input_ids,
    p = ...                                        # batch.position_ids, batch.attention_mask
    result = verify_tree(batch, p, greedy, g)      # tree_verify.py
    plan = tree.reroot(result.tokens)              # plan.apply(cache, seq_dim); run plan.recompute

For losslessness at temperature > 0 in sample mode, decide *how many* expansions to run without
looking at the drawn tokens (a fixed d or the clock; ``len(tree)`` too while every q has at least
c tokens of positive probability) and pick leaves only with ``leaves_to_expand``: the tree itself
never lets token values steer its shape.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import torch

from testbed.spec.tree_io import KVCompactionPlan, TreeBatch, TreeMode


@dataclass(eq=False)
class DraftTree:
    """A draft token tree: struct-of-lists, node id = index; treat the lists as read-only."""

    root_token: int
    prefix_len: int = 0
    mode: TreeMode = "topk"
    tokens: list[int] = field(init=False)
    parents: list[int] = field(init=False)
    depths: list[int] = field(init=False)
    values: list[float] = field(init=False)  # log q_parent(token); 0 at the root
    weights: list[float] = field(init=False)  # sum of values from the root (cumulative log-prob)
    priors: list[float] = field(init=False)  # per-node priority increment (= value in topk mode)
    priorities: list[float] = field(init=False)  # sum of priors from the root: the heap key
    dists: list[torch.Tensor | None] = field(init=False)  # q at the node once expanded
    slots: list[int] = field(init=False)  # tree KV slot, -1 until expanded
    children: list[Sequence[int]] = field(init=False)  # in draw order; () until expanded
    draw_index: list[int] = field(init=False)  # rank among the parent's children
    n_slots: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.mode not in ("topk", "sample"):
            raise ValueError(f"mode={self.mode!r}: expected 'topk' or 'sample'")
        self._reset(self.root_token)

    def _reset(self, root_token: int) -> None:
        self.root_token = root_token
        self.tokens, self.parents, self.depths = [root_token], [-1], [0]
        self.values, self.weights, self.priors, self.priorities = [0.0], [0.0], [0.0], [0.0]
        self.dists, self.slots, self.children, self.draw_index = [None], [-1], [()], [0]
        self.n_slots = 0
        self._frontier: list[tuple[float, int]] = [(0.0, 0)]  # (-priority, id): see leaves_to_expand
        self._queued: list[int] = [0]  # per node: how many of its children entered the frontier

    # ---- queries -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    def key(self, node: int) -> tuple[float, int]:
        """The total order of the tree: smaller key = more probable."""
        return (-self.priorities[node], node)

    def is_expanded(self, node: int) -> bool:
        return self.slots[node] >= 0

    def path(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` (both included)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root to ``node`` (both included): the node's context in the tree."""
        return [self.tokens[n] for n in self.path(node)]

    def child_with_token(self, node: int, token: int) -> int:
        for child in self.children[node]:
            if self.tokens[child] == token:
                return child
        return -1

    def leaves_to_expand(self, w: int) -> list[int]:
        """The w unexpanded nodes of highest priority (ties: lower id), best first."""
        # The frontier is a heap of unexpanded nodes that holds, of each node's children (whose
        # priorities fall with their rank), only those up to the best unexpanded one: popping a
        # child queues its next sibling, so nodes leave the heap in the order a heap of every
        # unexpanded node would give, while it holds O(expanded) entries, not O(tree) — pushing
        # every child of every expansion dominated the simulator's async runs under load.
        # Expanded nodes are dropped lazily, when they surface here.
        heap, best, slots = self._frontier, [], self.slots
        while heap and len(best) < w:
            entry = heapq.heappop(heap)
            self._queue_next_sibling(entry[1])
            if slots[entry[1]] < 0:
                best.append(entry)
        for entry in best:
            heapq.heappush(heap, entry)
        return [node for _, node in best]

    def _queue_next_sibling(self, node: int) -> None:
        parent = self.parents[node]
        if parent >= 0 and self._queued[parent] == self.draw_index[node] + 1:
            siblings = self.children[parent]
            if len(siblings) > self._queued[parent]:
                nxt = siblings[self._queued[parent]]
                heapq.heappush(self._frontier, (-self.priorities[nxt], nxt))
                self._queued[parent] += 1

    def positions(self, node_ids: Sequence[int]) -> torch.Tensor:
        """Position ids prefix_len + depth."""
        return torch.tensor([self.depths[n] for n in node_ids], dtype=torch.long) + self.prefix_len

    def expansion_mask(self, node_ids: Sequence[int], include_prefix: bool = True) -> torch.Tensor:
        """Non-square mask for the draft forward over ``node_ids`` (SwiftSpec Fig. 4).

        Shape (w, [prefix_len +] n_slots + w): columns are the prefix cache (all visible), the
        tree slots in use (visible when the slot holds an ancestor) and the w new entries (each
        node sees itself) — the KV of ``node_ids[j]`` is written to tree slot n_slots + j.
        """
        w, base = len(node_ids), (self.prefix_len if include_prefix else 0)
        mask = torch.zeros(w, base + self.n_slots + w, dtype=torch.bool)
        mask[:, :base] = True
        for j, node in enumerate(node_ids):
            mask[j, base + self.n_slots + j] = True
            anc = self.parents[node]
            while anc >= 0:
                mask[j, base + self.slots[anc]] = True
                anc = self.parents[anc]
        return mask

    # ---- growth ------------------------------------------------------------------------
    def expand(
        self,
        node_ids: Sequence[int],
        dists: torch.Tensor,
        num_children: int | None = None,
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """Record q = ``dists[j]`` at ``node_ids[j]`` (which get tree slots n_slots + j) and add
        up to ``num_children`` (default: len(node_ids)) children per node; tokens of zero
        probability are never added. Returns the new node ids."""
        if not node_ids:
            return []
        dists = dists.reshape(len(node_ids), -1)
        c = min(num_children if num_children is not None else len(node_ids), dists.shape[-1])
        for node in node_ids:
            if self.slots[node] >= 0:
                raise ValueError(f"node {node} is already expanded")
        # the i-th largest probabilities: children (topk) or the shape's priors (sample)
        top_p, top_idx = torch.topk(dists, c, dim=-1)
        if self.mode == "sample":
            # ordered sampling without replacement (exponential race: token x arrives at
            # E_x / q(x), E = -log U ~ Exp(1)); the arrival order is the sequential draw order.
            # Zero-probability tokens get key 0 and come last (dropped below). -log U is ~5x
            # faster than Tensor.exponential_ on CPU.
            race = torch.rand(dists.shape, generator=generator, device=dists.device, dtype=dists.dtype)
            race = torch.div(dists, race.log_().neg_(), out=race)
            draws = torch.topk(race, c, dim=-1).indices
            child_p, child_tok = dists.gather(-1, draws).tolist(), draws.tolist()
            rank_p = top_p.tolist()  # the priors; topk mode reads none (each copy: a GPU sync)
        else:
            child_p, child_tok = top_p.tolist(), top_idx.tolist()
        rows = dists.unbind(0)  # every row's view in one call (indexing costs ~3 µs a row)
        new: list[int] = []
        for j, node in enumerate(node_ids):
            self.dists[node] = rows[j]
            self.slots[node] = self.n_slots
            self.n_slots += 1
            w_parent, prio_parent, depth = self.weights[node], self.priorities[node], self.depths[node] + 1
            ps = child_p[j]
            # support exhausted at the first zero (ranks and draws are sorted by probability)
            m = c if ps[-1] > 0.0 else next((i for i, p in enumerate(ps) if p <= 0.0), c)
            if m == 0:
                continue
            # whole children at once (list.extend): the simulator's async draft grows ~10^3
            # nodes per round per request and re-simulates runs for prediction intervals
            values = list(map(math.log, ps if m == c else ps[:m]))
            priors = values if self.mode == "topk" else list(map(math.log, rank_p[j][:m]))
            ids = range(len(self.tokens), len(self.tokens) + m)
            self.tokens.extend(child_tok[j] if m == c else child_tok[j][:m])
            self.parents.extend(repeat(node, m))
            self.depths.extend(repeat(depth, m))
            self.values.extend(values)
            self.weights.extend([w_parent + v for v in values])
            self.priors.extend(priors)
            self.priorities.extend([prio_parent + p for p in priors])
            self.dists.extend(repeat(None, m))
            self.slots.extend(repeat(-1, m))
            self.children.extend(repeat((), m))  # an unexpanded node's children: a shared ()
            self.draw_index.extend(range(m))
            self._queued.extend(repeat(0, m))
            self.children[node] = list(ids)
            new.extend(ids)
            # its best child enters the frontier, the others one by one (leaves_to_expand)
            heapq.heappush(self._frontier, (-self.priorities[ids[0]], ids[0]))
            self._queued[node] = 1
        return new

    # ---- verification batch ------------------------------------------------------------
    def select_subtree(self, bs: int) -> TreeBatch:
        """The ``min(bs, len)`` nodes of smallest key, i.e. highest priority (best-first from the
        root: keys grow along edges, so this set is closed under parent). Guarantee: every node
        outside has a key larger than every node inside; in topk mode priority = cumulative
        draft log-prob, so no node outside is more probable than a node inside."""
        if bs < 1:
            raise ValueError(f"bs={bs}: need at least the root")
        order: list[int] = []
        frontier = [(-self.priorities[0], 0)]
        while frontier and len(order) < bs:
            _, node = heapq.heappop(frontier)
            order.append(node)
            for child in self.children[node]:
                heapq.heappush(frontier, (-self.priorities[child], child))
        index = {node: i for i, node in enumerate(order)}
        parents = [index.get(self.parents[n], -1) for n in order]
        children: list[list[int]] = [[] for _ in order]
        for node in sorted(order)[1:]:  # by id = draw order among siblings
            children[index[self.parents[node]]].append(index[node])
        return TreeBatch(
            node_ids=order,
            tokens=[self.tokens[n] for n in order],
            parents=parents,
            depths=[self.depths[n] for n in order],
            children=children,
            draw_index=[self.draw_index[n] for n in order],
            draft_probs=[self.dists[n] for n in order],
            mode=self.mode,
            prefix_len=self.prefix_len,
        )

    # ---- re-rooting --------------------------------------------------------------------
    def reroot(self, verified_tokens: Sequence[int]) -> KVCompactionPlan:
        """Advance past ``verified_tokens`` (the tokens emitted after the root, bonus included).

        The old root and all verified tokens but the last join the prefix; the last one becomes
        the root. If it is a node of the tree (reached by walking down along the tokens) its
        subtree is kept, renumbered in the old order, with its KV slots packed to 0..k-1 in the
        old slot order (parents before children); otherwise the tree restarts from it.
        """
        old_prefix, n_old = self.prefix_len, len(self.tokens)
        n_ver = len(verified_tokens)
        if n_ver == 0:
            slots = [s for s in self.slots if s >= 0]
            return KVCompactionPlan(
                old_prefix, old_prefix, (), (), tuple((s, s) for s in sorted(slots)), (),
                tuple(range(n_old)), True,
            )
        walk = [0]
        for tok in verified_tokens:
            node = walk[-1]
            walk.append(self.child_with_token(node, int(tok)) if node >= 0 else -1)
        to_prefix, recompute = [], []
        for depth in range(n_ver):  # old root, then every verified token but the last
            node, pos = walk[depth], old_prefix + depth
            if node >= 0 and self.slots[node] >= 0:
                to_prefix.append((self.slots[node], pos))
            else:
                recompute.append(pos)
        new_root = walk[-1]
        kept = self._subtree(new_root) if new_root >= 0 else []
        node_map = [-1] * n_old
        for new_id, old_id in enumerate(kept):
            node_map[old_id] = new_id
        kept_slots = sorted(self.slots[n] for n in kept if self.slots[n] >= 0)
        keep = tuple((s, d) for d, s in enumerate(kept_slots))
        used = {s for s, _ in to_prefix} | set(kept_slots)
        free = tuple(s for s in sorted(x for x in self.slots if x >= 0) if s not in used)
        self.prefix_len = old_prefix + n_ver
        if new_root >= 0:
            self._compact(kept, node_map, {s: d for s, d in keep})
        else:
            self._reset(int(verified_tokens[-1]))
        return KVCompactionPlan(
            old_prefix, self.prefix_len, tuple(to_prefix), tuple(recompute), keep, free,
            tuple(node_map), new_root >= 0,
        )

    def _subtree(self, node: int) -> list[int]:
        """Ids of ``node`` and its descendants, ascending (= creation order)."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(self.children[n])
        return sorted(out)

    def _compact(self, kept: list[int], node_map: list[int], slot_map: dict[int, int]) -> None:
        """Renumber the tree to ``kept`` (ascending old ids; kept[0] is the new root)."""
        old = (self.tokens, self.parents, self.depths, self.values, self.priors, self.dists,
               self.slots, self.children, self.draw_index)
        tokens, parents, depths, values, priors, dists, slots, children, draw_index = old
        base_depth = depths[kept[0]]
        self.tokens = [tokens[n] for n in kept]
        self.parents = [node_map[parents[n]] if i else -1 for i, n in enumerate(kept)]
        self.depths = [depths[n] - base_depth for n in kept]
        self.values = [values[n] if i else 0.0 for i, n in enumerate(kept)]
        self.priors = [priors[n] if i else 0.0 for i, n in enumerate(kept)]
        self.dists = [dists[n] for n in kept]
        self.slots = [slot_map.get(slots[n], -1) for n in kept]
        self.children = [[node_map[c] for c in children[n]] if children[n] else () for n in kept]
        self.draw_index = [draw_index[n] if i else 0 for i, n in enumerate(kept)]
        # cumulative sums restart at the new root (parents precede children in id order)
        self.weights, self.priorities = [0.0] * len(kept), [0.0] * len(kept)
        for i in range(1, len(kept)):
            par = self.parents[i]
            self.weights[i] = self.weights[par] + self.values[i]
            self.priorities[i] = self.priorities[par] + self.priors[i]
        self.root_token = self.tokens[0]
        self.n_slots = len(slot_map)
        # the frontier (leaves_to_expand): the root if unexpanded, and each node's children up
        # to its best unexpanded one
        self._frontier = [(-self.priorities[0], 0)] if self.slots[0] < 0 else []
        self._queued = [0] * len(kept)
        for i, kids in enumerate(self.children):
            for kid in kids:
                self._queued[i] += 1
                if self.slots[kid] < 0:
                    self._frontier.append((-self.priorities[kid], kid))
                    break
        heapq.heapify(self._frontier)
