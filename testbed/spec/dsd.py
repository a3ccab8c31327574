"""DSD adaptive verification (seed 003, §2.3 and Algorithm 1) for a chain of γ draft tokens.

Each drafted token y_j is a *key token* (eq. 7) when any of

    H_d(y_j) / H_t(y_j) > λ1     H_m(y) = -log P_m(y), the token's cross entropy under model m
    |P_t(y_j) - P_d(y_j)| > λ2
    NormMatch_j < λ3             NormMatch = |S_t ∩ S_d| / max(|S_t|, |S_d|), S_m = the top-k
                                 tokens of P_m that have positive probability (so one-hot rows
                                 compare their single tokens, full rows give |∩| / k)

holds. H_t is floored at 1e-6 nats so a certain target (H_t = 0) makes the ratio large, not NaN.
Key tokens are verified against P_t; the others against the softened target (eq. 8)

    P̃_t ∝ P_t^(1-τ) · P_d^τ      (τ = 0: P_t exactly; a row where the product vanishes — disjoint
                                  supports — falls back to P_t)

by building the per-position target rows and running Algorithm 1 (``speculative_step``) on them,
so a rejected non-key token is resampled from residual(P̃_t, P_d) and the bonus token comes from
P_t. τ = 0 is exactly Algorithm 1. With τ > 0 the output is deliberately *not* the target's
distribution: DSD trades that for longer accepted spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.spec.sampling import SamplingParams
from testbed.spec.speculative import SpecStep, speculative_step

_TINY = 1e-30
_MIN_TARGET_ENTROPY = 1e-6


def draft_params(params: SamplingParams, topk: int) -> SamplingParams:
    """The DSD draft's sampling: the run's, cut to its top ``topk`` at temperature > 0, so its
    distributions travel as top-k exactly (real/schedules/decentralized.py) and the simulator
    charges the same sampling mode (sim/cost/profile.py)."""
    if params.greedy or topk <= 0:
        return params
    k = min(params.top_k, topk) if params.top_k > 0 else topk
    return SamplingParams(params.temperature, k, params.top_p)


def key_tokens(
    p_t: torch.Tensor,
    p_d: torch.Tensor,
    *, tokens: torch.Tensor,
    lambda1: float,
    lambda2: float,
    lambda3: float,
    topk: int = 10,
) -> torch.Tensor:
    """Eq. 7: bool [γ], True for key tokens. ``p_t``, ``p_d`` [γ, V] at the drafted positions."""
    idx = tokens.view(-1, 1)
    pt_y = p_t.gather(-1, idx).squeeze(-1)
    pd_y = p_d.gather(-1, idx).squeeze(-1)
    h_t = -torch.log(pt_y.clamp_min(_TINY))
    h_d = -torch.log(pd_y.clamp_min(_TINY))
    ratio_key = h_d / h_t.clamp_min(_MIN_TARGET_ENTROPY) > lambda1
    gap_key = (pt_y - pd_y).abs() > lambda2
    return ratio_key | gap_key | (norm_match(p_t, p_d, topk) < lambda3)


def norm_match(p_t: torch.Tensor, p_d: torch.Tensor, topk: int = 10) -> torch.Tensor:
    """Normalized top-k support overlap in [0, 1] per row (module docstring)."""
    k = min(topk, p_t.shape[-1])
    val_t, idx_t = torch.topk(p_t, k, dim=-1)
    val_d, idx_d = torch.topk(p_d, k, dim=-1)
    live_t, live_d = val_t > 0, val_d > 0
    same = (idx_t.unsqueeze(-1) == idx_d.unsqueeze(-2)) & live_t.unsqueeze(-1) & live_d.unsqueeze(-2)
    overlap = same.any(dim=-1).sum(dim=-1)  # top-k indices are distinct: at most one match each
    size = torch.maximum(live_t.sum(dim=-1), live_d.sum(dim=-1)).clamp_min(1)
    return overlap / size


def soften(p_t: torch.Tensor, p_d: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 8: P_t^(1-τ)·P_d^τ renormalized per row; τ = 0 returns ``p_t`` itself."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau={tau}: allowed range is [0, 1]")
    if tau == 0.0:
        return p_t
    if tau == 1.0:
        mixed = p_d.clone()
    else:  # in log space: 0^a = 0 for a > 0 and no underflow of small products
        logits = (1.0 - tau) * torch.log(p_t) + tau * torch.log(p_d)
        # normalized by hand: CPU torch.softmax goes multi-threaded even on tiny tensors, which
        # costs milliseconds per call when cores are shared
        mixed = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
    dead = ~torch.isfinite(mixed).all(dim=-1, keepdim=True) | (mixed.sum(dim=-1, keepdim=True) <= 0)
    return torch.where(dead, p_t, mixed)


@dataclass
class DSDStep:
    step: SpecStep  # Algorithm 1's result on the per-position target rows
    key: list[bool]  # per drafted position: verified strictly against P_t

    @property
    def key_fraction(self) -> float:
        return sum(self.key) / len(self.key) if self.key else 0.0


def dsd_verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    tau: float,
    *,
    lambda1: float,
    lambda2: float,
    lambda3: float,
    topk: int = 10,
    generator: torch.Generator | None = None,
) -> DSDStep:
    """DSD Algorithm 1: p [γ+1, V] (target), q [γ, V] (draft), γ drafted tokens."""
    gamma = int(draft_tokens.numel())
    if gamma == 0:
        return DSDStep(speculative_step(p, q, draft_tokens=draft_tokens, generator=generator), [])
    key = key_tokens(p[:gamma], q, tokens=draft_tokens, lambda1=lambda1, lambda2=lambda2, lambda3=lambda3, topk=topk)
    rows = p
    if tau > 0.0 and not bool(key.all()):
        strict_or_soft = torch.where(key.unsqueeze(-1), p[:gamma], soften(p[:gamma], q, tau))
        rows = torch.cat([strict_or_soft, p[gamma:]], dim=0)
    return DSDStep(speculative_step(rows, q, draft_tokens=draft_tokens, generator=generator), key.tolist())
