"""Token trees on real models (`sync_tree`, `async`): tree-masked forwards and KV compaction.

The mirror of sim/oracle/tree_tokens.py: the tree (growth, selection, re-rooting, the KV plan) is
``testbed.spec.tree.DraftTree`` and the verification ``testbed.spec.tree_verify``; this module
says where the distributions come from when they come from real models, and keeps the two KV
caches in step with the tree.

Cache layout, as DraftTree defines it. Both caches hold the committed prefix in slots
``0..prefix_len-1``; the root (the last committed token) is never in the prefix.

- Draft: tree slot s is cache slot ``prefix_len + s``. An expansion forward feeds the w leaves
  (written to the next free tree slots, RoPE position prefix_len + depth) with the non-square
  mask of ``DraftTree.expansion_mask`` (prefix, the ancestors' slots, itself), and in the same
  forward the verified tokens whose KV the draft never computed (``KVCompactionPlan.recompute``:
  prefix positions, causal over the prefix), so leaves see them at once. After a re-root
  ``KVCompactionPlan`` moves the verified path into the prefix and packs the kept subtree.
- Target: the verification batch (root first, parents before children) is written at slots
  ``prefix_len + i`` with the batch's tree mask; afterwards the accepted path's KV moves to the
  positions prefix_len + depth (the root is already in place), so the next round's prefix is
  exactly what causal decoding would have written.

At temperature 0 the tree grows in ``topk`` mode ranked by the draft's softmax at temperature 1
(the standardized q is one-hot and would make every tree a chain) and is verified greedily: the
output is greedy `ar` token for token. At temperature > 0 it grows in ``sample`` mode from the
standardized q, verified by the lossless multi-candidate rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import DraftSource
from testbed.spec.tree_io import KVCompactionPlan, TreeBatch
from testbed.spec.tree_verify import verify_tree


class ForwardModel(Protocol):
    """What a tree needs of a model: a masked forward and cache moves. A single-process
    ``Transformer`` (through ``LocalModel``) or the leader of a tensor-parallel group."""

    def logits(self, tokens: Sequence[int], *, input_pos: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor: ...

    def move_kv(self, src: Sequence[int], dst: Sequence[int]) -> None: ...


class LocalModel:
    """A ``real.model.decoder.Transformer`` in this process, as a ``ForwardModel``.
    ``device_logits``: a replayed forward's logits stay on the GPU (the serial tree at
    temperature 0 ranks the leaves and takes the argmax there and copies back only those; at
    temperature > 0 the draws use host generators, so the logits come to the host)."""

    def __init__(self, model, *, device_logits: bool = False) -> None:  # model: real.model.decoder.Transformer
        self.model = model
        self.device_logits = device_logits

    @torch.inference_mode()
    def logits(self, tokens: Sequence[int], *, input_pos: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        graphs = None if self.model.keep_hidden else self.model.graph_forwards
        if graphs is not None:  # replayed from a CUDA graph (real.model.cuda_graphs) where one applies
            logits = graphs.tree_logits(tokens, input_pos=input_pos, mask=mask, position_ids=position_ids,
                                        to_host=not self.device_logits)
            if logits is not None:
                return logits
        x = torch.tensor([list(tokens)], device=self.model.device)
        return self.model(x, input_pos=input_pos, mask=mask, position_ids=position_ids)[0]

    @torch.inference_mode()
    def move_kv(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if src:
            self.model.move_kv(torch.tensor(list(src)), torch.tensor(list(dst)))


@dataclass
class TreeOutcome:
    tokens: list[int]  # accepted tokens, then the target's own token (the bonus)
    accepted: int
    checked: int  # accepted + 1 when the stop node had candidates that were all rejected
    features: torch.Tensor | None = None  # the target's of the root and the accepted (features_of)


def checked_count(batch: TreeBatch, accepted_nodes: list[int]) -> int:
    """Accepted guesses plus one when the walk stopped at a node whose candidates all failed."""
    stop = batch.node_ids.index(accepted_nodes[-1]) if accepted_nodes else 0
    return len(accepted_nodes) + (1 if batch.children[stop] else 0)


def expansion_inputs(tree: DraftTree, pending: list[int], nodes: list[int], *, first_slot: int = 0,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache slots, mask, RoPE positions) of a draft forward over the ``pending`` prefix positions
    (each sees the prefix up to itself) and then the leaves ``nodes`` (tree.expansion_mask);
    slots below ``first_slot`` are never attended."""
    prefix, slots = tree.prefix_len, tree.n_slots
    mask = torch.zeros(len(pending) + len(nodes), prefix + slots + len(nodes), dtype=torch.bool)
    for row, pos in enumerate(pending):
        mask[row, : pos + 1] = True
    mask[len(pending):] = tree.expansion_mask(nodes)
    mask[:, :first_slot] = False
    pend_t = torch.tensor(pending, dtype=torch.long)
    new_slots = torch.arange(prefix + slots, prefix + slots + len(nodes))
    return torch.cat([pend_t, new_slots]), mask, torch.cat([pend_t, tree.positions(nodes)])


class DraftTreeTokens(DraftSource):
    """The draft side of one request, the ``DraftSource`` of testbed's ``TreeDrafter``:
    distributions from the draft model, its KV cache kept in step with the tree (expansions,
    re-roots)."""

    def __init__(self, model: ForwardModel, params: SamplingParams, history: list[int],
                 generator: torch.Generator | None = None) -> None:
        self.model, self.params, self._history = model, params, history
        self.generator = generator
        self.mode = "topk" if params.greedy else "sample"
        self.pending: list[int] = []  # prefix positions whose KV the draft never computed
        self.forwards = 0

    def history(self) -> list[int]:
        return self._history

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """One draft forward over the pending prefix tokens and the leaves ``nodes``;
        returns q after each leaf [len(nodes), V] (the ranking at temperature 0)."""
        pend = self.pending
        input_pos, mask, position_ids = expansion_inputs(tree, pend, nodes)
        logits = self.model.logits(
            [self._history[p] for p in pend] + [tree.tokens[n] for n in nodes],
            input_pos=input_pos, mask=mask, position_ids=position_ids)[len(pend):]
        self.pending = []
        self.forwards += 1
        if self.params.greedy:  # rank by the softmax at temperature 1 (module docstring)
            return torch.softmax(logits.float(), dim=-1)
        return standardize(logits, self.params)

    def commit(self, tokens: list[int]) -> None:
        self._history.extend(tokens)

    def compact(self, plan: KVCompactionPlan) -> None:
        """Make the draft cache match the re-rooted tree (DraftTree.reroot's plan)."""
        self.model.move_kv(plan.source_index(), plan.dest_index())
        self.pending.extend(plan.recompute)


@dataclass
class TargetTreeTokens:
    """The target side of one request: verify a batch in one tree-masked forward, then move the
    accepted path's KV into the prefix."""

    model: ForwardModel
    params: SamplingParams
    generator: torch.Generator | None = None
    forwards: int = 0
    # the target's hidden states of batch rows (a feature-level draft reads them), or None
    features_of: Callable[[list[int]], torch.Tensor] | None = None

    def verify(self, batch: TreeBatch) -> TreeOutcome:
        prefix, n = batch.prefix_len, len(batch)
        mask = torch.ones(n, prefix + n, dtype=torch.bool)
        mask[:, prefix:] = batch.attention_mask
        logits = self.model.logits(batch.tokens, input_pos=torch.arange(prefix, prefix + n),
                                   mask=mask, position_ids=batch.position_ids)
        self.forwards += 1
        p = standardize(logits, self.params)
        res = verify_tree(batch, p, self.params.greedy, self.generator)
        index = {node: i for i, node in enumerate(batch.node_ids)}
        src = [prefix + index[node] for node in res.accepted_nodes]
        dst = [prefix + 1 + d for d in range(len(src))]  # depth d+1 sits at prefix + d + 1
        moves = [(s, t) for s, t in zip(src, dst) if s != t]
        features = None
        if self.features_of is not None:  # read before the moves: rows in batch order
            features = self.features_of([0, *(index[node] for node in res.accepted_nodes)]).clone()
        if moves:
            self.model.move_kv([s for s, _ in moves], [t for _, t in moves])
        return TreeOutcome(res.tokens, res.accepted, checked_count(batch, res.accepted_nodes), features)


TREE_SLOTS = 2048  # draft KV slots reserved for the tree beyond the sequence (~5 KB each, trained draft)


def tree_cache_slots(sequence_len: int) -> int:
    """Draft KV slots a tree request needs: the sequence plus the tree's slots. How many tree
    slots are alive at once is not bounded by w, bs and d alone (a re-root keeps the expanded
    subtree of the new root, which later rounds grow further), so reserve generously; the
    model caps it at its context, and a tree that outgrows it fails with the model's message."""
    return sequence_len + TREE_SLOTS


def tree_models(ctx, *, device_logits: bool = False) -> tuple[ForwardModel, ForwardModel]:  # type: ignore[no-untyped-def]
    """(draft, target) as ForwardModels for a real schedule context: the models of this process,
    or the leaders' handles of tensor-parallel groups (``LocalModel``'s ``device_logits``)."""
    from real.errors import RealSetupError
    from real.model.drafts import ModelDraft
    from real.model.eagle import EagleDraft

    if isinstance(ctx.draft, EagleDraft):  # its source is real.model.eagle_tree's: no draft model here
        return None, LocalModel(ctx.target.model, device_logits=device_logits)  # type: ignore[return-value]
    if not isinstance(ctx.draft, ModelDraft):
        name = getattr(ctx.draft, "name", type(ctx.draft).__name__)
        raise RealSetupError(f"pair.draft={name!r} cannot grow a token tree (schedule.tree=true "
                             "and schedule=async need a draft model with its own KV cache): "
                             "use pair=smollm2_135m+smollm2_draft or schedule.tree=false")
    return (LocalModel(ctx.draft.model, device_logits=device_logits),
            LocalModel(ctx.target.model, device_logits=device_logits))
