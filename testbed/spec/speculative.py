"""Speculative sampling, exactly Algorithm 1 of Leviathan et al. (seed 001).

One implementation for both backends. The decision rule is split out as ``accepted_prefix``
(ratios p_i(x_i)/q_i(x_i) and uniforms in, number of accepted guesses out) so that the
simulator's i.i.d. oracle — where every ratio is α — runs the very same rule at full speed
without building distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.spec.prefix import accepted_prefix  # noqa: F401  (torch-free, for the iid oracle)
from testbed.spec.sampling import sample


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p'(x) = norm(max(0, p(x) - q(x))); p itself when p == q (then a rejection never occurs)."""
    diff = torch.clamp(p - q, min=0.0)
    total = diff.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp_min(1e-30), p)


def acceptance_ratios(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """p_i(x_i) / q_i(x_i) for each guess (inf-safe: q(x)=0 never happens for sampled x)."""
    idx = tokens.view(-1, 1)
    p_x = p.gather(-1, idx).squeeze(-1)
    q_x = q.gather(-1, idx).squeeze(-1)
    return p_x / q_x.clamp_min(1e-30)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) (Theorem 3.5), per row."""
    return torch.minimum(p, q).sum(dim=-1)


@dataclass
class SpecStep:
    accepted: int  # n: draft tokens kept
    tokens: list[int]  # x_1..x_n followed by the one token t sampled from p'
    ratios: list[float]  # p_i(x_i)/q_i(x_i) for the γ guesses (for traces)


def speculative_step(
    p: torch.Tensor,
    q: torch.Tensor,
    *, draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: list[float] | None = None,
) -> SpecStep:
    """Algorithm 1 after the forwards: p [γ+1, V] from the target, q [γ, V] and the γ guesses
    drawn from q by the draft. Returns the accepted guesses plus one token from the target."""
    gamma = int(draft_tokens.numel())
    assert p.shape[0] == gamma + 1 and q.shape[0] == gamma, (p.shape, q.shape, gamma)
    ratios = acceptance_ratios(p[:gamma], q, draft_tokens).tolist() if gamma else []
    # r ~ U(0, 1]: with U[0, 1) an r of exactly 0 would accept a guess the target gives p = 0
    # (``uniforms`` given: drawn earlier by a caller that had to know the verdicts while
    # drafting — the simulator's lookahead oracle)
    if uniforms is None:
        uniforms = (1.0 - torch.rand(gamma, generator=generator)).tolist() if gamma else []
    n = accepted_prefix(ratios, uniforms)
    p_next = residual(p[n], q[n]) if n < gamma else p[n]
    t = sample(p_next, generator)
    return SpecStep(accepted=n, tokens=[int(x) for x in draft_tokens[:n].tolist()] + [t], ratios=ratios)
