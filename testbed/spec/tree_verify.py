"""Verification of a draft token tree against the target, exact at every temperature.

Inputs: a ``TreeBatch`` (tree.py) and ``p`` [n, V], the target's standardized distribution of
the next token at every batch node (row 0 = after the root). Nothing here calls a model.

Temperature 0 (``verify_greedy``): from the root, take the target's argmax; descend while a
selected child carries it; emit the matched tokens and the argmax at the stop node (the bonus).
This is autoregressive greedy decoding, token for token.

Temperature > 0 (``verify_sampled``): recursive rejection sampling. At the current node with
target p and selected children x_1..x_m in the order they were drawn, for i = 1..m:

    x_i was drawn from proposal q_i;  accept x_i with probability min(1, p(x_i)/q_i(x_i))
    accepted -> emit x_i, descend into it (fresh p = target at x_i);  rejected -> p <- residual(p, q_i)

and when no child is accepted emit one token from the final p. ``residual`` and the decision rule
(``accepted_prefix``) are those of Algorithm 1 (speculative.py): each step *is* a Leviathan step.

Why it is lossless. Claim: from step i, the emitted token is distributed as p_i. The last step
samples from p_{m+1}. Step i draws x_i ~ q_i, keeps it with probability min(1, p_i/q_i), else
continues with p_{i+1} = residual(p_i, q_i) — which does not depend on the value of x_i — so by
induction a rejection leads to a token ~ p_{i+1}, and Leviathan's Theorem (seed 001, Appendix A.1)
gives P(token = y) = min(p_i(y), q_i(y)) + (1 - Σ min(p_i, q_i)) · p_{i+1}(y) = p_i(y). Given the
accepted x_i the same argument applies one level down, so every emitted token has the target's
conditional distribution. Two conditions make "x_i ~ q_i" true:

1. q_i is the law of x_i given x_1..x_{i-1}. Sample-mode trees draw children *without*
   replacement from the node's q, so q_i = q with x_1..x_{i-1} removed and renormalized (children
   are distinct tokens, and a rejected token is never drawn again: higher acceptance than with
   replacement). Top-k trees place deterministic tokens, so q_i is the point mass at x_i: the
   rule then accepts x_i with probability p_i(x_i) and removes it from p — the same as sampling
   from p and looking for a matching child — lossless at any temperature.
2. Whether x_i is offered at all may not depend on x_i or later draws. The selected children are
   a prefix of the draws, and in sample mode the tree's shape (expansion and selection order) is
   computed from the ranked probabilities of q, never from the drawn tokens (tree.py). A re-rooted
   tree starts at the bonus token, which the target never examined, so its subtree is fresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.spec.sampling import sample
from testbed.spec.speculative import accepted_prefix, residual
from testbed.spec.tree_io import TreeBatch


@dataclass
class TreeVerifyResult:
    accepted_nodes: list[int]  # tree node ids of the accepted draft tokens, root excluded
    tokens: list[int]  # the accepted tokens followed by the one token from the target
    tested: int  # draft candidates compared with the target (for acceptance-rate metrics)

    @property
    def accepted(self) -> int:
        return len(self.accepted_nodes)


def verify_greedy(batch: TreeBatch, target: torch.Tensor) -> TreeVerifyResult:
    """Greedy path match. ``target`` [n, V]: probabilities or logits (only the argmax counts)."""
    best = target.argmax(dim=-1).tolist()
    node, accepted, tokens, tested = 0, [], [], 0
    while True:
        tested += len(batch.children[node])
        nxt = next((c for c in batch.children[node] if batch.tokens[c] == best[node]), -1)
        if nxt < 0:
            break
        node = nxt
        accepted.append(batch.node_ids[node])
        tokens.append(batch.tokens[node])
    tokens.append(best[node])
    return TreeVerifyResult(accepted, tokens, tested)


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[token] = 1.0
    return out


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """The law of the next draw without replacement once ``token`` has been drawn."""
    out = q.clone()
    out[token] = 0.0
    return out / out.sum().clamp_min(1e-30)


def verify_sampled(
    batch: TreeBatch, p: torch.Tensor, generator: torch.Generator | None = None
) -> TreeVerifyResult:
    """Recursive rejection sampling over the tree (module docstring); ``p`` [n, V]."""
    device = generator.device if generator is not None else p.device
    sampled = batch.mode == "sample"
    node, accepted, tokens, tested = 0, [], [], 0
    target = p[0]
    while True:
        kids = batch.children[node]
        if sampled and kids:
            proposal = batch.draft_probs[node]
            if proposal is None:
                raise ValueError(f"batch node {node} has children but no draft distribution")
            if [batch.draw_index[c] for c in kids] != list(range(len(kids))):
                raise ValueError(f"children of batch node {node} are not a prefix of the draws")
        nxt = -1
        for kid in kids:
            x = batch.tokens[kid]
            q_i = proposal if sampled else _point_mass(x, target)
            ratio = float(target[x]) / max(float(q_i[x]), 1e-30)
            tested += 1
            if accepted_prefix([ratio], (1.0 - torch.rand(1, generator=generator, device=device)).tolist()):
                nxt = kid
                break
            target = residual(target, q_i)
            if sampled:
                proposal = _without(proposal, x)
        if nxt < 0:
            break
        node = nxt
        accepted.append(batch.node_ids[node])
        tokens.append(batch.tokens[node])
        target = p[node]
    tokens.append(sample(target, generator))
    return TreeVerifyResult(accepted, tokens, tested)


def verify_tree(
    batch: TreeBatch,
    p: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Dispatch: ``greedy`` (temperature 0) -> ``verify_greedy``, else ``verify_sampled``."""
    assert p.shape[0] == len(batch), (p.shape, len(batch))
    return verify_greedy(batch, p) if greedy else verify_sampled(batch, p, generator)
