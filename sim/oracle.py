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
- ``trace``: see sim/oracle_trace.py (replays acceptance recorded by a real run).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from testbed.config import ExperimentConfig
from testbed.spec.sampling import SamplingParams, sample, standardize
from testbed.spec.speculative import accepted_prefix, expected_acceptance, speculative_step


@dataclass
class ChainOutcome:
    accepted: int  # guesses kept
    tokens: list[int] = field(default_factory=list)  # emitted ids (empty for iid)
    ratios: list[float] = field(default_factory=list)
    proposed: int | None = None  # guesses actually drafted when fewer than γ (trace: n-gram); None = γ


class SequenceOracle(ABC):
    """Token source for one request: advances its own sequence as tokens are emitted."""

    @abstractmethod
    def ar_token(self) -> int:
        """The target's next token (one AR forward)."""

    @abstractmethod
    def chain_round(self, gamma: int) -> ChainOutcome:
        """One round of Algorithm 1 with γ guesses; the sequence advances by accepted+1."""


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

    def chain_round(self, gamma: int) -> ChainOutcome:
        r = self.rng.random
        n = accepted_prefix([self.alpha] * gamma, [r() for _ in range(gamma)])
        return ChainOutcome(accepted=n)


class IidOracle(TokenOracle):
    def __init__(self, exp: ExperimentConfig, seed: int) -> None:
        self.alpha = exp.acceptance.alpha
        self.rng = random.Random(seed)

    def sequence(self, request_id: int, prompt_len: int) -> SequenceOracle:
        return IidSequence(self.alpha, self.rng)


# ----------------------------------------------------------------------------------------------


_SIGMA_CACHE: dict[tuple[int, int, SamplingParams, float], float] = {}


class SyntheticLM:
    """Procedural bigram target/draft logits; deterministic in (seed, last two tokens)."""

    SHARPNESS = 2.5  # scale of the target logits: sets the target's entropy (~2–3 nats at V=512)

    def __init__(self, vocab: int, seed: int, params: SamplingParams, alpha: float,
                 cache_size: int = 65536) -> None:
        g = np.random.default_rng(seed)
        self.vocab = vocab
        self.params = params
        s = self.SHARPNESS / np.sqrt(2.0)
        self.E = torch.from_numpy((g.standard_normal((vocab, vocab)) * s).astype(np.float32))
        self.F = torch.from_numpy((g.standard_normal((vocab, vocab)) * s).astype(np.float32))
        self.G = torch.from_numpy((g.standard_normal((vocab, vocab)) / np.sqrt(2.0)).astype(np.float32))
        self.H = torch.from_numpy((g.standard_normal((vocab, vocab)) / np.sqrt(2.0)).astype(np.float32))
        self.sigma = 0.0
        self._cache: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._cache_size = cache_size
        # calibration is deterministic in these: a run's `ar` baseline and the jobs of a sweep
        # reuse it instead of bisecting again (seconds on a shared CPU)
        key = (vocab, seed, params, alpha)
        if key not in _SIGMA_CACHE:
            _SIGMA_CACHE[key] = self.calibrate(alpha)
        self.sigma = _SIGMA_CACHE[key]

    def logits(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.E[a] + self.F[b]
        return t, t + self.sigma * (self.G[a] + self.H[b])

    def dists(self, context: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, q): standardized target and draft next-token distributions after `context`."""
        key = (context[-2], context[-1])
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        t, d = self.logits(*key)
        out = (standardize(t, self.params), standardize(d, self.params))
        self._cache[key] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def acceptance(self, sigma: float, n: int = 256) -> float:
        """E over random contexts of Σ min(p, q) (= P(argmax match) at temperature 0)."""
        g = torch.Generator().manual_seed(12345)
        a = torch.randint(self.vocab, (n,), generator=g)
        b = torch.randint(self.vocab, (n,), generator=g)
        t = self.E[a] + self.F[b]
        d = t + sigma * (self.G[a] + self.H[b])
        return float(expected_acceptance(standardize(t, self.params), standardize(d, self.params)).mean())

    def calibrate(self, alpha: float) -> float:
        """σ with acceptance(σ) = α, by bisection (acceptance falls as σ grows)."""
        if alpha >= 1.0:
            return 0.0
        lo, hi = 0.0, 1.0
        while self.acceptance(hi) > alpha and hi < 1e4:
            lo, hi = hi, hi * 2
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.acceptance(mid) > alpha else (lo, mid)
        self._cache.clear()
        return 0.5 * (lo + hi)


class SyntheticSequence(SequenceOracle):
    def __init__(self, lm: SyntheticLM, prompt: list[int], gen: torch.Generator) -> None:
        self.lm, self.tokens, self.gen = lm, list(prompt), gen

    def ar_token(self) -> int:
        p, _ = self.lm.dists(self.tokens)
        t = sample(p, self.gen)
        self.tokens.append(t)
        return t

    def chain_round(self, gamma: int) -> ChainOutcome:
        ctx = self.tokens
        guesses: list[int] = []
        qs, ps = [], []
        for _ in range(gamma):
            p, q = self.lm.dists(ctx[-2:] if not guesses else (ctx + guesses)[-2:])
            x = sample(q, self.gen)
            qs.append(q)
            ps.append(p)
            guesses.append(x)
        p_last, _ = self.lm.dists((ctx + guesses)[-2:])
        ps.append(p_last)
        step = speculative_step(torch.stack(ps), torch.stack(qs) if qs else torch.empty(0, self.lm.vocab),
                                torch.tensor(guesses, dtype=torch.long), self.gen)
        self.tokens.extend(step.tokens)
        return ChainOutcome(accepted=step.accepted, tokens=step.tokens, ratios=step.ratios)


class SyntheticOracle(TokenOracle):
    produces_ids = True

    def __init__(self, exp: ExperimentConfig, seed: int) -> None:
        sp = exp.sampling
        params = SamplingParams(sp.temperature, sp.top_k, sp.top_p)
        # the language model depends on exp.seed only, so a run and its baseline share it
        self.lm = SyntheticLM(exp.acceptance.vocab, exp.seed, params, exp.acceptance.alpha)
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = exp.seed

    def sequence(self, request_id: int, prompt_len: int) -> SequenceOracle:
        # prompt ids depend on (seed, request) only: a run and its `ar` baseline see the same
        rng = random.Random(1_000_003 * self.seed + request_id)
        prompt = [rng.randrange(self.lm.vocab) for _ in range(max(2, min(prompt_len, 16)))]
        return SyntheticSequence(self.lm, prompt, self.gen)


ORACLES = {"iid": IidOracle, "synthetic": SyntheticOracle}


def make_oracle(exp: ExperimentConfig, seed: int) -> TokenOracle:
    name = exp.acceptance.oracle
    if name not in ORACLES:
        import importlib

        importlib.import_module(f"sim.oracle_{name}")  # registers itself in ORACLES
    return ORACLES[name](exp, seed)
