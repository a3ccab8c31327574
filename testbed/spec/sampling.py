"""Standardized sampling (Leviathan et al. §2.2): every decoding rule becomes a distribution.

Temperature, top-k and top-p are applied to logits in that order (as HF transformers does) and
the result is a probability vector; argmax (temperature 0) is the one-hot of the first maximum.
Speculative sampling then only ever deals with plain distributions ``p`` (target) and ``q``
(draft), both standardized with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbed_kernels import native


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted top-k of the last dim and per row the count of values >= the k-th (> k: a tie at
    the cut). The native kernel where it applies: torch.topk plus the count cost ~0.2 ms per
    49k-vocabulary row, and a verification standardizes gamma + 1 rows at every round."""
    found = native.topk(x, k)
    if found is not None:
        return found
    vals, idx = torch.topk(x, k, dim=-1)
    return vals, idx, (x >= vals[..., -1:]).sum(dim=-1)


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Per row the index of the first maximum [..., 1], as ``argmax``: the native top-1 (ties
    lower index first) where it applies, 0.06 against 0.31 ms for a verification's 5 rows of the
    49k vocabulary on one core (a greedy round standardizes every draft step and verified row)."""
    found = native.topk(x, 1)
    return found[1] if found is not None else x.argmax(dim=-1, keepdim=True)


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
        out.scatter_(-1, _first_max(logits), 1.0)
        return out
    x = logits / params.temperature
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k:
        vals, idx, n_ge = _topk(x, top_k)  # sorted, descending
        if not bool((n_ge == top_k).all()):
            # ties at the k-th value are kept, as HF does: each row's n_ge values >= it are its
            # n_ge best (bf16 logits tie there more often than not); the wider top-k holds them
            # all, and a row's entries past its own count are masked (they add exact zeros)
            wide = int(n_ge.max())
            vals, idx, _ = _topk(x, wide)
            vals = vals.masked_fill(torch.arange(wide, device=x.device) >= n_ge[..., None], float("-inf"))
        # the kept set is (vals, idx), already sorted: no pass over the vocabulary
        probs = torch.softmax(vals, dim=-1)
        if params.top_p < 1.0:
            return _keep_head(x, probs, idx, params.top_p)
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).scatter_(-1, idx, probs)
    if params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    return nucleus(x, params.top_p)


def nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over logits ``x`` [..., V]: the smallest most-probable prefix whose mass reaches
    ``top_p`` (a token is dropped when the mass strictly before it already reaches top_p; the
    first token is always kept; among equal probabilities the lower index comes first),
    renormalised.

    Why not sort: sorting 49k logits costs ~5 ms per distribution on one core, 50x a softmax,
    and only where the nucleus ends matters. The native kernel (``specbed_kernels.native.top_p_``) finds
    that boundary by a radix select over the probabilities' float bits, two histograms of mass
    and a sort of the few tokens left (~0.1 ms a row whatever the nucleus's size: a
    verification's γ + 1 rows at T = 1, top-p 0.95 went from 12-26 % to 2-4 % of its forward,
    ``benchmarks/bench_sampling.py --verify``). Without it: the 32 most probable tokens
    (``topk``) hold the nucleus of most language-model distributions; otherwise, guess a
    probability t from a sorted 1/16 subsample (its scaled prefix mass estimates where the
    nucleus ends, with a margin), check exactly that {p >= t} holds mass >= top_p (else lower
    t), and sort only that set. It is a head of the full sorted order holding mass >= top_p, so
    every token outside it is dropped and the result is what the full sort gives (tests compare
    both paths with it). (With top-k first, ``standardize`` knows the candidates and keeps the
    head without this.)
    """
    probs = torch.softmax(x, dim=-1).contiguous()
    if native.top_p_(probs, top_p):  # in place; the kernel selects by radix, not by sorting
        return probs
    # a language model's nucleus is usually a handful of tokens: its 32 best hold the mass
    head_p, head_idx, _ = _topk(probs, min(_FIRST_GUESS, probs.shape[-1]))
    # the same float64 prefix sum _keep_head uses: what the first token outside would see
    if bool((torch.cumsum(head_p.double(), dim=-1)[..., -1] >= top_p).all()):
        return _keep_head(x, head_p, head_idx, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.empty_like(flat)
    for row, p in enumerate(flat):
        head = (p >= _head_threshold(p, top_p)).nonzero().squeeze(-1)
        head_sorted, order = torch.sort(p[head], descending=True, stable=True)  # ties: lower index first
        out[row] = _keep_head(p, head_sorted, head[order], top_p)
    return out.reshape(x.shape)


_STRIDE = 16
_FIRST_GUESS = 32


def _head_threshold(p: torch.Tensor, top_p: float) -> float:
    """A probability t with mass(p >= t) >= top_p and not many more tokens than needed.

    The sorted 1/16 subsample's scaled prefix mass says roughly where the nucleus ends (a
    heavy tail can make it miss mass, hence the renormalisation and the margin); an exact
    check of mass(p >= t) then gallops down the subsample until it holds."""
    sub = torch.sort(p[::_STRIDE], descending=True).values
    est = torch.cumsum(sub, dim=0)
    j = int(torch.searchsorted(est / est[-1], torch.tensor([top_p], device=est.device))[0])
    j = min(len(sub) - 1, j + j // 4 + 2)
    while j < len(sub) - 1:
        t = float(sub[j])
        if float(torch.where(p >= t, p, 0.0).sum(dtype=torch.float64)) >= top_p:  # float32 would round up to top_p
            return t
        j = min(len(sub) - 1, 2 * j + 1)
    return float(p.min())  # the whole vocabulary


def _keep_head(x: torch.Tensor, probs_sorted: torch.Tensor, idx: torch.Tensor,
               top_p: float) -> torch.Tensor:
    # float64 prefix sums: over a nucleus of tens of thousands of tokens float32 rounding
    # would decide the boundary token
    p64 = probs_sorted.double()
    before = torch.cumsum(p64, dim=-1) - p64
    kept_mass = torch.where(before < top_p, probs_sorted, torch.zeros_like(probs_sorted))
    # renormalised on the head, then scattered: no pass over the vocabulary but the zeros
    kept_mass = kept_mass / kept_mass.sum(dim=-1, keepdim=True)
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).scatter_(-1, idx, kept_mass)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a probability vector [V] (unnormalised weights too): its CDF inverted at
    one uniform, the cumulative sum in float64 (a float32 one drifts by up to ~V ulps on a 49k
    vocabulary; float64's error is ~1e-12 of a probability). A token of probability 0 owns an
    empty interval and is never drawn. torch.multinomial draws the same law at 8-14x the cost
    on a CPU (1.24-1.34 against 0.10-0.15 ms over the bundled 49,152 tokens, one core:
    ``benchmarks/bench_sampling.py``), which every sampled draft guess and verified token paid."""
    cdf = torch.cumsum(probs.reshape(-1), 0, dtype=torch.float64)
    device = generator.device if generator is not None else cdf.device
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=device).to(cdf.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_max(cdf.numel() - 1))


SAMPLING_MODES = ("greedy", "temperature", "top_k", "top_p", "top_k_top_p")


def sampling_mode(params: SamplingParams) -> str:
    """Which of SAMPLING_MODES `standardize` runs for `params` (its cost depends only on this,
    the vocabulary and the shape of the logits): the calibration times each, the simulator
    charges the experiment's."""
    if params.greedy:
        return "greedy"
    top_k, top_p = params.top_k > 0, params.top_p < 1.0
    if top_k and top_p:
        return "top_k_top_p"
    return "top_k" if top_k else "top_p" if top_p else "temperature"
