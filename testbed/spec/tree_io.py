"""What a draft token tree (testbed.spec.tree) hands to the backends: the subtree a target
verifies in one tree-masked forward (``TreeBatch``) and the moves that make a draft's KV cache
match a re-rooted tree (``KVCompactionPlan``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

TreeMode = Literal["topk", "sample"]


@dataclass(frozen=True)
class KVCompactionPlan:
    """How to rearrange the draft KV cache after a re-root.

    Tree slots are relative to the *old* prefix end for sources and to the *new* prefix end for
    destinations; prefix positions are absolute cache indices.
    """

    old_prefix_len: int
    new_prefix_len: int
    to_prefix: tuple[tuple[int, int], ...]  # (old tree slot, prefix position): the verified path
    recompute: tuple[int, ...]  # prefix positions whose KV the draft never computed
    keep: tuple[tuple[int, int], ...]  # (old tree slot, new tree slot), new slots = 0..len-1
    free: tuple[int, ...]  # old tree slots whose KV is dropped
    node_map: tuple[int, ...]  # old node id -> new node id, -1 if the node is gone
    root_in_tree: bool  # the new root was a node of the old tree (its subtree is reused)

    @property
    def new_tree_slots(self) -> int:
        return len(self.keep)

    def source_index(self) -> list[int]:
        """Absolute cache indices to read, aligned with ``dest_index``."""
        base = self.old_prefix_len
        return [base + s for s, _ in self.to_prefix] + [base + s for s, _ in self.keep]

    def dest_index(self) -> list[int]:
        """Absolute cache indices to write, aligned with ``source_index``."""
        base = self.new_prefix_len
        return [pos for _, pos in self.to_prefix] + [base + d for _, d in self.keep]

    def apply(self, cache: torch.Tensor, seq_dim: int) -> None:
        """Reference compaction of one cache tensor in place along ``seq_dim`` (reads first, so
        overlapping moves are safe). Positions in ``recompute`` are left for the caller."""
        src, dst = self.source_index(), self.dest_index()
        if not src:
            return
        src_t = torch.tensor(src, device=cache.device)
        dst_t = torch.tensor(dst, device=cache.device)
        cache.index_copy_(seq_dim, dst_t, cache.index_select(seq_dim, src_t))


@dataclass
class TreeBatch:
    """A connected subtree selected for one target verification, parents before children.

    ``parents``/``children`` are indices into this batch (root = 0, parent -1); children are in
    the order they were drawn. ``draft_probs[i]`` is q at node i if it was expanded, else None.
    ``draw_index[i]`` is node i's rank among its parent's children (0 for the root).
    """

    node_ids: list[int]
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    children: list[list[int]]
    draw_index: list[int]
    draft_probs: list[torch.Tensor | None]
    mode: TreeMode
    prefix_len: int

    def __len__(self) -> int:
        return len(self.node_ids)

    @cached_property
    def input_ids(self) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long)

    @cached_property
    def position_ids(self) -> torch.Tensor:
        """prefix_len + depth for each node."""
        return torch.tensor(self.depths, dtype=torch.long) + self.prefix_len

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[n, n] bool, True where row i may attend column j: j is i or an ancestor of i."""
        n = len(self.node_ids)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents come first, so row parent is complete
            mask[i] |= mask[self.parents[i]]
        return mask
