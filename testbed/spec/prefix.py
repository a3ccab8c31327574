"""Algorithm 1's accepted-prefix rule, without torch: the i.i.d. oracle of the simulator needs
only this, and a simulated run should not pay torch's import time for it."""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(ratios: Sequence[float], uniforms: Sequence[float]) -> int:
    """n = min({i-1 | 1<=i<=γ, r_i > p_i(x_i)/q_i(x_i)} ∪ {γ})."""
    for i, (ratio, r) in enumerate(zip(ratios, uniforms)):
        if r > ratio:
            return i
    return len(ratios)
