"""Token oracles: where the simulator's draft and target token distributions come from.

The acceptance *decisions* are always made by the testbed's own algorithms
(testbed.spec.speculative), the same ones the real backend calls:

- ``iid`` (Leviathan's model): every guess has acceptance ratio α; the rule is
  ``accepted_prefix`` with ratios [α]*γ. No token ids are produced.
- ``synthetic``: a cheap procedural bigram language model with correlated draft and target
  logits (target: E[a] + F[b] over the last two tokens a, b; draft: target + σ·noise), with σ
  calibrated so that the draft's acceptance rate equals ``acceptance.alpha`` under the run's
  sampling settings. Distributions are standardized by ``standardize`` and verified with
  ``speculative_step``, so trees and DSD rules see real-looking distributions.
- ``trace``: see sim/oracle/trace.py (replays acceptance recorded by a real run).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from testbed.config import ExperimentConfig
from testbed.registry import Registry
from testbed.spec.lookahead import Decision, LookaheadPolicy
from testbed.spec.prefix import accepted_prefix


@dataclass
class ChainOutcome:
    accepted: int  # guesses kept
    tokens: list[int] = field(default_factory=list)  # emitted ids (empty for iid)
    ratios: list[float] = field(default_factory=list)
    proposed: int | None = None  # guesses actually drafted when fewer than γ (trace: n-gram); None = γ
    dropped: int = 0  # lookahead=oracle: a guess drafted then dropped (it costs a draft forward)


class SequenceOracle(ABC):
    """Token source for one request: advances its own sequence as tokens are emitted."""

    @abstractmethod
    def ar_token(self) -> int:
        """The target's next token (one AR forward)."""

    @abstractmethod
    def chain_round(self, gamma: int, policy: LookaheadPolicy | None = None) -> ChainOutcome:
        """One round of Algorithm 1 with up to γ guesses; the sequence advances by accepted+1.
        ``policy`` (lookahead) decides after every guess whether the draft goes on."""


class TokenOracle(ABC):
    """Builds one SequenceOracle per request."""

    produces_ids = False

    @abstractmethod
    def sequence(self, request_id: int, prompt_len: int) -> SequenceOracle: ...


# ----------------------------------------------------------------------------------------------


class IidSequence(SequenceOracle):
    def __init__(self, alpha: float, rng: random.Random) -> None:
        self.alpha, self.rng = alpha, rng

    def ar_token(self) -> int:
        return -1

    def chain_round(self, gamma: int, policy: LookaheadPolicy | None = None) -> ChainOutcome:
        r = self.rng.random
        if policy is None or not policy.per_token:
            n = accepted_prefix([self.alpha] * gamma, [r() for _ in range(gamma)])
            return ChainOutcome(accepted=n)
        # only the oracle policy runs here (config validation: no distributions, no features)
        uniforms: list[float] = []
        dropped = 0
        for i in range(gamma):
            u = r()
            if policy.after_token(features=None, position=i + 1, accepted=u <= self.alpha) is Decision.DROP:
                dropped = 1
                break
            uniforms.append(u)
        n = accepted_prefix([self.alpha] * len(uniforms), uniforms)
        return ChainOutcome(accepted=n, proposed=len(uniforms), dropped=dropped)


class IidOracle(TokenOracle):
    def __init__(self, exp: ExperimentConfig, seed: int) -> None:
        self.alpha = exp.acceptance.alpha
        self.rng = random.Random(seed)

    def sequence(self, request_id: int, prompt_len: int) -> SequenceOracle:
        return IidSequence(self.alpha, self.rng)


# ----------------------------------------------------------------------------------------------


# the values of acceptance= (conf/acceptance/): synthetic and trace register themselves when first used
ORACLES: Registry[type[TokenOracle]] = Registry("acceptance")
ORACLES.register("iid", IidOracle)
ORACLES.declare("synthetic", "sim.oracle.synthetic")
ORACLES.declare("trace", "sim.oracle.trace")


def make_oracle(exp: ExperimentConfig, seed: int) -> TokenOracle:
    return ORACLES.get(exp.acceptance.oracle)(exp, seed)
