"""Standardized sampling (Leviathan et al. §2.2): every decoding rule becomes a distribution.

Temperature, top-k and top-p are applied to logits in that order (as HF transformers does) and
the result is a probability vector; argmax (temperature 0) is the one-hot of the first maximum.
Speculative sampling then only ever deals with plain distributions ``p`` (target) and ``q``
(draft), both standardized with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def standardize(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) under temperature/top-k/top-p."""
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # strictly before it already reaches top_p (the first token is always kept)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a probability vector [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
