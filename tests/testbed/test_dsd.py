"""DSD adaptive verification: key-token rule (eq. 7), softened target (eq. 8), Algorithm 1."""

from __future__ import annotations

import math

import pytest
import torch

from testbed.spec.dsd import dsd_verify, key_tokens, norm_match, soften
from testbed.spec.sampling import sample
from testbed.spec.speculative import speculative_step
from tests.helpers.spec_oracle import single_thread, tv_distance


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


NEVER = dict(lambda1=math.inf, lambda2=2.0, lambda3=0.0)  # no token can be key
ALWAYS = dict(lambda1=math.inf, lambda2=-1.0, lambda3=0.0)  # every token is key


def _rand_dists(gen, rows, vocab, scale=2.0):
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)


def test_each_key_criterion_fires_on_its_own():
    tok = torch.tensor([0])
    # cross-entropy ratio: target sure of token 0 (H_t small), draft unsure (H_d large)
    p_t = torch.tensor([[0.9, 0.05, 0.05]])
    p_d = torch.tensor([[0.6, 0.2, 0.2]])
    ratio = math.log(0.6) / math.log(0.9)  # H_d / H_t = 4.85
    assert key_tokens(p_t, p_d, tokens=tok, lambda1=ratio - 0.1, lambda2=1.0, lambda3=0.0, topk=2).tolist() == [True]
    assert key_tokens(p_t, p_d, tokens=tok, lambda1=ratio + 0.1, lambda2=1.0, lambda3=0.0, topk=2).tolist() == [False]
    # probability gap |0.9 - 0.6| = 0.3
    assert key_tokens(p_t, p_d, tokens=tok, lambda1=math.inf, lambda2=0.29, lambda3=0.0, topk=2).tolist() == [True]
    assert key_tokens(p_t, p_d, tokens=tok, lambda1=math.inf, lambda2=0.31, lambda3=0.0, topk=2).tolist() == [False]
    # NormMatch: top-2 of p_t = {0, 1 or 2}, top-2 of p_d = {0, 1 or 2}
    p_d2 = torch.tensor([[0.6, 0.0, 0.4]])
    p_t2 = torch.tensor([[0.6, 0.4, 0.0]])
    assert norm_match(p_t2, p_d2, topk=2).tolist() == [0.5]
    assert key_tokens(p_t2, p_d2, tokens=tok, lambda1=math.inf, lambda2=1.0, lambda3=0.51, topk=2).tolist() == [True]
    assert key_tokens(p_t2, p_d2, tokens=tok, lambda1=math.inf, lambda2=1.0, lambda3=0.49, topk=2).tolist() == [False]


def test_key_tokens_vectorized_and_certain_target_is_finite():
    p_t = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    p_d = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    toks = torch.tensor([0, 1])
    # row 0: H_t = 0, H_d = log 2 -> huge ratio (not NaN); row 1 identical distributions
    assert key_tokens(p_t, p_d, tokens=toks, lambda1=1.5, lambda2=2.0, lambda3=0.0).tolist() == [True, False]


def test_norm_match_bounds():
    gen = torch.Generator().manual_seed(0)
    p = _rand_dists(gen, 4, 16)
    assert norm_match(p, p, topk=5).tolist() == [1.0] * 4
    one_a, one_b = torch.eye(6)[[1]], torch.eye(6)[[4]]
    assert norm_match(one_a, one_a, topk=3).tolist() == [1.0]
    assert norm_match(one_a, one_b, topk=3).tolist() == [0.0]
    q = _rand_dists(gen, 50, 16)
    m = norm_match(p.repeat(13, 1)[:50], q, topk=4)
    assert ((m >= 0) & (m <= 1)).all()


def test_soften_endpoints_and_formula():
    gen = torch.Generator().manual_seed(1)
    p_t, p_d = _rand_dists(gen, 3, 7), _rand_dists(gen, 3, 7)
    assert soften(p_t, p_d, 0.0) is p_t  # exactly P_t
    assert torch.allclose(soften(p_t, p_d, 1.0), p_d)
    mixed = soften(p_t, p_d, 0.3)
    manual = p_t**0.7 * p_d**0.3
    assert torch.allclose(mixed, manual / manual.sum(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(soften(p_t, p_t, 0.4), p_t, atol=1e-6)
    with pytest.raises(ValueError):
        soften(p_t, p_d, 1.5)


def test_soften_disjoint_supports_falls_back_to_target():
    p_t = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    p_d = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.5, 0.5, 0.0]])
    out = soften(p_t, p_d, 0.5)
    assert out[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert out[1].tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])  # overlap only on token 1


def _draft(gen, gamma=4, vocab=8):
    q = _rand_dists(gen, gamma, vocab)
    p = _rand_dists(gen, gamma + 1, vocab)
    tokens = torch.tensor([sample(row, gen) for row in q])
    return p, q, tokens


def test_tau_zero_is_exactly_algorithm1():
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        p, q, tokens = _draft(gen)
        state = gen.get_state()
        ref = speculative_step(p, q, draft_tokens=tokens, generator=gen)
        gen.set_state(state)
        got = dsd_verify(p, q, tokens, 0.0, lambda1=1.5, lambda2=0.3, lambda3=0.5, topk=3, generator=gen)
        assert (got.step.accepted, got.step.tokens) == (ref.accepted, ref.tokens)
        assert got.step.ratios == ref.ratios
        assert got.key_fraction == sum(got.key) / 4


def test_all_key_tokens_verify_strictly_whatever_tau():
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        p, q, tokens = _draft(gen)
        state = gen.get_state()
        ref = speculative_step(p, q, draft_tokens=tokens, generator=gen)
        gen.set_state(state)
        got = dsd_verify(p, q, tokens, 0.8, **ALWAYS, generator=gen)
        assert (got.step.accepted, got.step.tokens) == (ref.accepted, ref.tokens)
        assert got.key_fraction == 1.0


def test_non_key_positions_follow_the_softened_target():
    # with no key token the first emitted token has exactly the law of soften(P_t, P_d, tau)
    gen = torch.Generator().manual_seed(4)
    p, q, _ = _draft(gen, gamma=2, vocab=5)
    tau, n = 0.5, 8_000  # here TV(soft, strict) = 0.56; sampling noise about 0.01
    firsts = []
    for _ in range(n):
        tokens = torch.tensor([sample(row, gen) for row in q])
        firsts.append((dsd_verify(p, q, tokens, tau, **NEVER, generator=gen).step.tokens[0],))
    soft = soften(p[:1], q[:1], tau)[0].tolist()
    strict = p[0].tolist()
    assert tv_distance(firsts, {(i,): v for i, v in enumerate(soft)}) < 0.03
    # and measurably not the strict target's law
    assert tv_distance(firsts, {(i,): v for i, v in enumerate(strict)}) > 0.3


def test_relaxation_lengthens_accepted_spans():
    gen = torch.Generator().manual_seed(5)
    strict_total = relaxed_total = 0
    for _ in range(2000):
        p, q, tokens = _draft(gen)
        state = gen.get_state()
        strict_total += dsd_verify(p, q, tokens, 0.0, **NEVER, generator=gen).step.accepted
        gen.set_state(state)
        relaxed_total += dsd_verify(p, q, tokens, 0.5, **NEVER, generator=gen).step.accepted
    assert relaxed_total > 1.2 * strict_total


def test_empty_draft():
    p = torch.tensor([[0.0, 1.0]])
    out = dsd_verify(p, torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), 0.3,
                     lambda1=1.5, lambda2=0.3, lambda3=0.5)
    assert out.step.tokens == [1] and out.key == [] and out.key_fraction == 0.0
