"""Closed forms from the seed papers, used by reports and tests to check the simulator."""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan et al. eq. (1): E[tokens per verification] = (1 − α^(γ+1)) / (1 − α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: expected walltime improvement (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def dsd_speedup(alpha: float, gamma: int, *, c: float, t0: float, t1: float, nodes: int) -> float:
    """Decentralized sync SD over a pipeline of `nodes` stages with per-link latency t1 and
    target compute t0 per forward (all stages together), against `ar` over the same pipeline:
    E·(t0 + (N−1)t1) / (γ·c·t0 + t0 + (N−1)t1)."""
    comm = (nodes - 1) * t1
    return expected_tokens(alpha, gamma) * (t0 + comm) / (gamma * c * t0 + t0 + comm)


def dsd_comm_reduction(k: float, t0: float, t1: float, nodes: int) -> float:
    """DSD eq. (5): R_comm = (N−1)·t1·(k−1) / (k·(t0 + (N−1)·t1))."""
    comm = (nodes - 1) * t1
    return comm * (k - 1.0) / (k * (t0 + comm))
