"""Test helper: a procedural target/draft pair over a small vocabulary, plus TV distances.

``TokenOracle.p(ctx)`` / ``.q(ctx)`` give standardized next-token distributions for any context
(a tuple of token ids), drawn once per context from a seed derived from the context, so every
path through a token tree sees consistent, correlated target and draft distributions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from testbed.spec.sampling import SamplingParams, standardize


@dataclass
class TokenOracle:
    vocab: int
    seed: int = 0
    target: SamplingParams = SamplingParams(temperature=1.0)
    draft: SamplingParams = SamplingParams(temperature=1.0)
    draft_noise: float = 1.0  # draft logits = target logits + noise * N(0, 1)
    target_support: tuple[int, ...] | None = None  # tokens allowed under the target (None = all)
    draft_support: tuple[int, ...] | None = None
    _cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def _rows(self, ctx: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._cache.get(ctx)
        if rows is None:
            key = self.seed
            for tok in ctx:
                key = (key * 1_000_003 + tok + 1) % (2**61 - 1)
            gen = torch.Generator().manual_seed(key)
            t_logits = torch.randn(self.vocab, generator=gen) * 1.5
            d_logits = t_logits + self.draft_noise * torch.randn(self.vocab, generator=gen)
            rows = (
                standardize(_restrict(t_logits, self.target_support), self.target),
                standardize(_restrict(d_logits, self.draft_support), self.draft),
            )
            self._cache[ctx] = rows
        return rows

    def p(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self._rows(ctx)[0]

    def q(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self._rows(ctx)[1]

    def exact_first(self, ctx: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        p = self.p(ctx).tolist()
        return {(a,): p[a] for a in range(self.vocab) if p[a] > 0}

    def exact_pair(self, ctx: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        out = {}
        for (a,), pa in self.exact_first(ctx).items():
            pb = self.p(ctx + (a,)).tolist()
            out.update({(a, b): pa * pb[b] for b in range(self.vocab) if pb[b] > 0})
        return out


def _restrict(logits: torch.Tensor, support: tuple[int, ...] | None) -> torch.Tensor:
    if support is None:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[list(support)] = True
    return logits.masked_fill(~keep, float("-inf"))


def tv_distance(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Total variation between the empirical law of ``samples`` and ``exact``."""
    counts = Counter(samples)
    n = len(samples)
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one CPU thread: these tests use tiny tensors, and CPU ops such as softmax
    go multi-threaded regardless of size, which costs milliseconds per call on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
