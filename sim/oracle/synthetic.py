"""The `synthetic` token oracle (see sim/oracle/base.py): a procedural bigram language model with
correlated draft and target logits. In its own module because it needs torch, which a run with
the i.i.d. oracle does not import."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import torch

from sim.oracle.base import ORACLES, ChainOutcome, SequenceOracle, TokenOracle
from testbed.config import ExperimentConfig
from testbed.spec.lookahead import Decision, LookaheadPolicy, draft_token_features
from testbed.spec.sampling import SamplingParams, sample, standardize
from testbed.spec.speculative import expected_acceptance, speculative_step

_SIGMA_CACHE: dict[tuple[int, int, SamplingParams, float], float] = {}


class SyntheticLM:
    """Procedural bigram target/draft logits; deterministic in (seed, last two tokens)."""

    SHARPNESS = 2.5  # scale of the target logits: sets the target's entropy (~2–3 nats at V=512)

    def __init__(self, vocab: int, seed: int, params: SamplingParams, alpha: float, *,
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

    def chain_round(self, gamma: int, policy: LookaheadPolicy | None = None) -> ChainOutcome:
        ctx = self.tokens
        guesses: list[int] = []
        qs, ps = [], []
        per_token = policy is not None and policy.per_token
        # the oracle policy must know each verdict while drafting: its uniforms are drawn here
        # and handed to Algorithm 1 (same rule, same distribution of outcomes)
        uniforms: list[float] | None = [] if per_token and policy.needs_acceptance else None
        dropped = 0
        for i in range(gamma):
            last2 = ctx[-2:] if not guesses else (ctx + guesses)[-2:]
            p, q = self.lm.dists(last2)
            x = sample(q, self.gen)
            if per_token:
                assert policy is not None
                feats = draft_token_features(self.lm.logits(*last2)[1], x) if policy.needs_features else None
                verdict = None
                if uniforms is not None:
                    u = 1.0 - float(torch.rand(1, generator=self.gen))
                    verdict = u <= float(p[x]) / float(q[x])
                decision = policy.after_token(features=feats, position=i + 1, accepted=verdict)
                if decision is Decision.DROP:
                    dropped = 1
                    break
                if uniforms is not None:
                    uniforms.append(u)
            qs.append(q)
            ps.append(p)
            guesses.append(x)
            if per_token and decision is Decision.STOP:
                break
        p_last, _ = self.lm.dists((ctx + guesses)[-2:])
        ps.append(p_last)
        step = speculative_step(torch.stack(ps), torch.stack(qs) if qs else torch.empty(0, self.lm.vocab),
                                draft_tokens=torch.tensor(guesses, dtype=torch.long), generator=self.gen, uniforms=uniforms)
        self.tokens.extend(step.tokens)
        return ChainOutcome(accepted=step.accepted, tokens=step.tokens, ratios=step.ratios,
                            proposed=len(guesses), dropped=dropped)


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



ORACLES.register("synthetic", SyntheticOracle)
