"""Token trees from an eagle head (real.model.eagle): the ``DraftSource`` of the serial tree.

Pair position p holds (f_{p-1}, x_p), as in the chain (``EagleDraft``). A tree node at depth d
sits at position prefix_len + d; feeding it needs the feature of its parent: the target's
f_{prefix_len-1} for the root (the target has processed every committed token but the root),
else the head's own prediction f̂ at the parent, kept per tree slot when the parent was
expanded. After a verification the target's features of the old root and the accepted tokens
(``verified_features``) join the prefix, and those positions are fed again with them, so the
prefix the head attends to is built from the target's features only, as after a chain round.
The head's slot 0 never holds a pair (no feature precedes the first token): it is masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from real.model.batch import Feed
from real.model.eagle import EagleDraft, RowEagleDraft, eagle_rows_tree
from real.model.tree_tokens import expansion_inputs
from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import DraftSource
from testbed.spec.tree_io import KVCompactionPlan


class EagleTreeTokens(DraftSource):
    """The draft side of one request of the serial tree with an eagle head; ``draft.start``
    (the target's prompt features) has run. ``cache_slots``: the head's KV slots the request
    needs (its sequence and the tree's slots, real.model.tree_tokens.tree_cache_slots)."""

    reads_features = True

    def __init__(self, draft: EagleDraft, params: SamplingParams, history: list[int], *,
                 cache_slots: int, generator: torch.Generator | None = None) -> None:
        if draft.head.body.max_seq < cache_slots:
            draft.head.body.setup_cache(cache_slots)  # before any pair is fed: nothing is lost
        self.draft, self.params, self._history = draft, params, history
        self.generator = generator
        self.mode = "topk" if params.greedy else "sample"
        self.pending = list(range(1, len(history) - 1))  # prefix pairs the head has not fed
        dim = draft.target.args.dim
        self.slot_features = torch.zeros(64, dim, dtype=draft.target.dtype, device=draft.target.device)
        self.forwards = 0

    def history(self) -> list[int]:
        return self._history

    def _parent_feature(self, tree: DraftTree, node: int) -> Tensor:
        parent = tree.parents[node]
        if parent < 0:
            return self.draft.features[tree.prefix_len - 1]
        return self.slot_features[tree.slots[parent]]

    @torch.inference_mode()
    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> Tensor:
        """One head forward over the pending prefix pairs and the leaves ``nodes``; q after each
        leaf ``[len(nodes), V]`` (the ranking at temperature 0)."""
        d, pend = self.draft, self.pending
        prefix, slots = tree.prefix_len, tree.n_slots
        width = prefix + slots + len(nodes)
        if self._slots_per_row() < width:
            raise RuntimeError(f"eagle: the tree needs {width} KV slots of the head, it has "
                               f"{self._slots_per_row()}")
        input_pos, mask, position_ids = expansion_inputs(tree, pend, nodes, first_slot=1)  # slot 0: no pair
        tokens = [self._history[p] for p in pend] + [tree.tokens[n] for n in nodes]
        feats = torch.stack([d.features[p - 1] for p in pend] + [self._parent_feature(tree, n) for n in nodes])
        leaves, logits = self._head_forward(tokens, feats, input_pos, mask, position_ids, len(nodes))
        if self.slot_features.shape[0] < slots + len(nodes):
            grown = torch.zeros(2 * (slots + len(nodes)), leaves.shape[-1], dtype=leaves.dtype, device=leaves.device)
            grown[: self.slot_features.shape[0]] = self.slot_features
            self.slot_features = grown
        self.slot_features[slots: slots + len(nodes)] = leaves
        self.pending = []
        self.forwards += 1
        if self.params.greedy:  # rank by the softmax at temperature 1 (as DraftTreeTokens)
            return torch.softmax(logits.float(), dim=-1)
        return standardize(logits, self.params)

    def _slots_per_row(self) -> int:
        return self.draft.head.body.max_seq

    def _head_forward(self, tokens: list[int], feats: Tensor, input_pos: Tensor, mask: Tensor,
                      position_ids: Tensor, leaves: int) -> tuple[Tensor, Tensor]:
        """(the head's features f̂ of the last ``leaves`` rows ``[leaves, dim]``, their logits)."""
        head, target = self.draft.head, self.draft.target
        u = head.inputs(target, torch.tensor([tokens], device=target.device), feats[None])
        h = head.body.forward_layers(u, input_pos, mask, position_ids=position_ids)[0, len(tokens) - leaves:]
        return h, head.logits(target, h[None])[0]

    def verified_features(self, features: Tensor | None) -> None:
        """The target's features ``[1 + accepted, dim]`` of the old root and the accepted tokens,
        at positions ``len(history) - 1 ..`` (called before ``commit``)."""
        if features is None:
            raise RuntimeError("eagle: the target's verification kept no hidden states")
        self.draft.take_features(len(self._history) - 1, features)

    def commit(self, tokens: list[int]) -> None:
        self._history.extend(tokens)

    def compact(self, plan: KVCompactionPlan) -> None:
        """Keep the surviving subtree's KV and features; the new prefix pairs are fed again with
        the target's features (their KV held the head's own)."""
        src = [plan.old_prefix_len + s for s, _ in plan.keep]
        dst = [plan.new_prefix_len + n for _, n in plan.keep]
        if src:
            self._move_kv(src, dst)
            moved = self.slot_features[[s for s, _ in plan.keep]].clone()
            self.slot_features[: len(plan.keep)] = moved
        self.pending.extend(p for p in range(plan.old_prefix_len, plan.new_prefix_len) if p not in self.pending)

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        self.draft.head.body.move_kv(torch.tensor(src), torch.tensor(dst))

    def placeholder_features(self, n: int) -> Tensor:
        """Zeros in the shape of the target's features of ``n`` positions (calibration times
        what does not depend on their values)."""
        return torch.zeros(n, self.draft.features.shape[1], dtype=self.draft.features.dtype,
                           device=self.draft.features.device)


class RowEagleTreeTokens(EagleTreeTokens):
    """The draft side of one of several requests whose serial trees grow in batched rounds
    (real/runtime/batching.py): the request's own row of the head's KV cache and its own
    features (``RowEagleDraft``); its head forwards meet the other requests' in one batched
    forward (``meet``, real/runtime/rendezvous.py; ``eagle_rows_tree``), which computes for
    each row what the one-request head computes."""

    def __init__(self, draft: RowEagleDraft, params: SamplingParams, history: list[int], *, meet: Any,
                 index: Callable[[], int], generator: torch.Generator | None = None) -> None:
        super().__init__(draft, params, history, cache_slots=0, generator=generator)  # the rows are sized
        self.row_draft, self.meet, self.index = draft, meet, index

    def _slots_per_row(self) -> int:
        return self.row_draft.rows.model.max_seq

    def _head_forward(self, tokens: list[int], feats: Tensor, input_pos: Tensor, mask: Tensor,
                      position_ids: Tensor, leaves: int) -> tuple[Tensor, Tensor]:
        d = self.row_draft
        feed = Feed(d.row, tokens, mask=mask, slots=[int(x) for x in input_pos],
                    positions=[int(x) for x in position_ids])
        return self.meet.call(self.index(), ("eagle_tree", id(d.head)), eagle_rows_tree,
                              (d.head, d.target, feed, feats, leaves))

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        self.row_draft.rows.move(self.row_draft.row, src, dst)
