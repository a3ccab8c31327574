"""Lookahead policies: how many tokens to draft in the next round (DESIGN: lookahead=...).

- static: always γ (Leviathan et al.).
- heuristic: HF assisted generation's schedule — +2 after a round where every guess was
  accepted, −1 otherwise, within [1, γ_max]; starts at γ_max.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LookaheadPolicy:
    gamma_max: int

    def next_gamma(self) -> int:
        return self.gamma_max

    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after a verification."""


@dataclass
class HeuristicLookahead(LookaheadPolicy):
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.gamma_max

    def next_gamma(self) -> int:
        return self.current

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.current = min(self.gamma_max, self.current + 2)
        else:
            self.current = max(1, self.current - 1)


def make_lookahead(policy: str, gamma_max: int) -> LookaheadPolicy:
    if policy == "static":
        return LookaheadPolicy(gamma_max)
    if policy == "heuristic":
        return HeuristicLookahead(gamma_max)
    raise ValueError(f"lookahead={policy!r}: allowed static, heuristic")
