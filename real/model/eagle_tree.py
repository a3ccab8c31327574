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

import torch
from torch import Tensor

from real.model.eagle import EagleDraft
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
        head, target = d.head, d.target
        prefix, slots = tree.prefix_len, tree.n_slots
        width = prefix + slots + len(nodes)
        if head.body.max_seq < width:
            raise RuntimeError(f"eagle: the tree needs {width} KV slots of the head, it has "
                               f"{head.body.max_seq}")
        input_pos, mask, position_ids = expansion_inputs(tree, pend, nodes, first_slot=1)  # slot 0: no pair
        tokens = torch.tensor([[self._history[p] for p in pend] + [tree.tokens[n] for n in nodes]],
                              device=target.device)
        feats = torch.stack([d.features[p - 1] for p in pend] + [self._parent_feature(tree, n) for n in nodes])
        u = head.inputs(target, tokens, feats[None])
        h = head.body.forward_layers(u, input_pos, mask, position_ids=position_ids)
        leaves = h[0, len(pend):]
        if self.slot_features.shape[0] < slots + len(nodes):
            grown = torch.zeros(2 * (slots + len(nodes)), leaves.shape[-1], dtype=leaves.dtype, device=leaves.device)
            grown[: self.slot_features.shape[0]] = self.slot_features
            self.slot_features = grown
        self.slot_features[slots: slots + len(nodes)] = leaves
        self.pending = []
        self.forwards += 1
        logits = target.head(leaves[None])[0]
        if self.params.greedy:  # rank by the softmax at temperature 1 (as DraftTreeTokens)
            return torch.softmax(logits.float(), dim=-1)
        return standardize(logits, self.params)

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
            self.draft.head.body.move_kv(torch.tensor(src), torch.tensor(dst))
            moved = self.slot_features[[s for s, _ in plan.keep]].clone()
            self.slot_features[: len(plan.keep)] = moved
        self.pending.extend(p for p in range(plan.old_prefix_len, plan.new_prefix_len) if p not in self.pending)
