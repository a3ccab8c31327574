"""Prompt lookup (the n-gram draft): no model, its guesses are continuations of earlier
occurrences of the sequence's last n tokens. One implementation for both backends and both
kinds of schedule.

``ngram_lookup(ids, ngram=, gamma=)`` — the chain draft of `sync`: the latest earlier occurrence
of the longest suffix (n = ngram down to 1) that has a continuation; up to γ tokens that followed
it. Its q is one-hot (Algorithm 1 then accepts x with probability p(x): lossless).

``ngram_counts(ids, ngram=)`` — the tree draft's distribution: over *every* earlier occurrence of
the longest matching suffix, how often each token followed it (ties broken towards the most
recent occurrence, so the most probable child is the chain's guess). A token tree needs several
candidates per node, which one occurrence cannot give; counts rank them by how often they
followed, and as a proper distribution they are a valid proposal for the lossless
multi-candidate rule at temperature > 0 (tree_verify: children are drawn from this q).

``NgramTreeSource(history, ngram=, vocab=, mode=, generator=)`` — the ``DraftSource`` of
``TreeDrafter``: ``draft_dists`` gives each node the normalized counts for (the committed tokens,
the node's path). A node whose context matches nothing gets q = 0 and no children (the tree
then stops growing there; the target still emits its own token). No KV cache: ``compact`` is
the default no-op.
"""

from __future__ import annotations

import torch

from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import DraftSource
from testbed.spec.tree_io import TreeMode

RECENCY_TIE_BREAK = 1e-3  # < 1: only orders tokens of equal count (latest occurrence first)


def ngram_lookup(ids: list[int], *, ngram: int, gamma: int) -> list[int]:
    """Up to ``gamma`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``ids`` (length ``ngram`` down to 1) that has a continuation; [] when none matches."""
    n_ids = len(ids)
    for n in range(min(ngram, n_ids - 1), 0, -1):
        suffix = ids[n_ids - n:]
        first = suffix[0]
        for j in range(n_ids - n - 1, -1, -1):  # latest first; j + n < n_ids: a continuation
            if ids[j] == first and ids[j:j + n] == suffix:
                return ids[j + n:j + n + gamma]
    return []


def ngram_counts(ids: list[int], *, ngram: int) -> dict[int, float]:
    """Token -> weight: how often it followed an earlier occurrence of the longest matching
    suffix (plus a recency tie-break below one count); {} when no suffix matches."""
    n_ids = len(ids)
    for n in range(min(ngram, n_ids - 1), 0, -1):
        suffix = ids[n_ids - n:]
        first = suffix[0]
        weights: dict[int, float] = {}
        for j in range(n_ids - n - 1, -1, -1):
            if ids[j] == first and ids[j:j + n] == suffix:
                nxt = ids[j + n]
                if nxt not in weights:  # first seen = most recent occurrence
                    weights[nxt] = RECENCY_TIE_BREAK * (j + 1) / n_ids
                weights[nxt] += 1.0
        if weights:
            return weights
    return {}


class NgramTreeSource(DraftSource):
    """The n-gram draft's distributions on the tree of one request (module docstring)."""

    def __init__(self, history: list[int], *, ngram: int, vocab: int, mode: TreeMode = "topk",
                 generator: torch.Generator | None = None) -> None:
        self._history, self.ngram, self.vocab = history, ngram, vocab
        self.mode, self.generator = mode, generator
        self.lookups = 0

    def history(self) -> list[int]:
        return self._history

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        q = torch.zeros(len(nodes), self.vocab)
        committed = self._history[:-1]  # the root is the tree's first path token
        for row, node in enumerate(nodes):
            weights = ngram_counts(committed + tree.path_tokens(node), ngram=self.ngram)
            self.lookups += 1
            if weights:
                total = sum(weights.values())
                for tok, w in weights.items():
                    q[row, tok] = w / total
        return q

    def commit(self, tokens: list[int]) -> None:
        self._history.extend(tokens)
