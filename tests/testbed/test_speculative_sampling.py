"""Standardized sampling and chain speculative sampling (Algorithm 1 of seed 001).

The statistical tests decode with Algorithm 1 on a procedural target/draft pair (a γ-token draft
sampled from q, verified by ``speculative_step``, repeated until two tokens are out) and compare
the law of the first emitted token and of the first two jointly with the exact target law, in
total variation. Resampling from p instead of the residual must fail the same tolerance.
"""

from __future__ import annotations

import pytest
import torch

import testbed.spec.speculative as speculative
from specbed_kernels import native
from testbed.spec.sampling import SamplingParams, sample, standardize
from testbed.spec.speculative import speculative_step
from tests.helpers.spec_oracle import TokenOracle, single_thread, tv_distance


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


DRAWS = 20_000
TV_FIRST = 0.02  # sampling noise at 20k draws over <= 8 outcomes is about 0.007
TV_PAIR = 0.04  # ... and about 0.02 over the <= 64 outcomes of two tokens

FAMILIES = {
    "t1.0": TokenOracle(vocab=6, seed=21),
    "t0.7-topk3": TokenOracle(
        vocab=8, seed=22, target=SamplingParams(0.7, top_k=3), draft=SamplingParams(0.9, top_k=5),
        draft_noise=1.5,
    ),
    "t1.3-topp0.8": TokenOracle(
        vocab=5, seed=23, target=SamplingParams(1.3, top_p=0.8), draft=SamplingParams(1.0, top_p=0.9)
    ),
    "disjoint": TokenOracle(vocab=6, seed=24, target_support=(0, 1, 2), draft_support=(3, 4, 5)),
    "sharp-draft": TokenOracle(vocab=6, seed=25, target=SamplingParams(1.5), draft=SamplingParams(0.4)),
}


def decode_chain(oracle: TokenOracle, gamma: int, n_tokens: int, gen: torch.Generator) -> list[int]:
    ctx: tuple[int, ...] = (0,)
    out: list[int] = []
    while len(out) < n_tokens:
        drafted, q_rows, p_rows = [], [], []
        for _ in range(gamma):  # the draft samples its guesses autoregressively from q
            q_rows.append(oracle.q(ctx + tuple(drafted)))
            p_rows.append(oracle.p(ctx + tuple(drafted)))
            drafted.append(sample(q_rows[-1], gen))
        p_rows.append(oracle.p(ctx + tuple(drafted)))
        step = speculative_step(torch.stack(p_rows), torch.stack(q_rows), draft_tokens=torch.tensor(drafted), generator=gen)
        assert step.tokens[:-1] == drafted[: step.accepted]
        out += step.tokens
        ctx += tuple(step.tokens)
    return out


def measure_tv(oracle: TokenOracle, gamma: int, draws: int = DRAWS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pairs = [tuple(decode_chain(oracle, gamma, 2, gen)[:2]) for _ in range(draws)]
    tv_first = tv_distance([pr[:1] for pr in pairs], oracle.exact_first((0,)))
    return tv_first, tv_distance(pairs, oracle.exact_pair((0,)))


# t1.0 (plain temperature 1) is slow: by default the two truncated and disjoint families here,
# and the real backend's sync at temperature 1 (test_real_engine, test_lookahead: 3000 draws
# each) check that law
@pytest.mark.parametrize(("family", "gamma"), [pytest.param("t1.0", 2, marks=pytest.mark.slow),
                                               ("t0.7-topk3", 3), ("disjoint", 2)])
def test_algorithm1_reproduces_the_target_law(family, gamma):
    tv_first, tv_pair = measure_tv(FAMILIES[family], gamma)
    assert tv_first < TV_FIRST and tv_pair < TV_PAIR, (tv_first, tv_pair)


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_algorithm1_reproduces_the_target_law_all_families(family, gamma):
    tv_first, tv_pair = measure_tv(FAMILIES[family], gamma, seed=1)
    assert tv_first < TV_FIRST and tv_pair < TV_PAIR, (tv_first, tv_pair)


def test_negative_control_resampling_from_p_fails(monkeypatch):
    # after a rejection, sample from p instead of norm(max(0, p - q)): biased towards q's tokens
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    tv_first, tv_pair = measure_tv(FAMILIES["sharp-draft"], 2, draws=5_000)
    assert tv_first > TV_FIRST and tv_pair > TV_PAIR, (tv_first, tv_pair)


def test_rejection_and_acceptance_are_exact_on_a_hand_case():
    p = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    # guess 0 accepted with probability 0.2; on rejection the residual is token 1 only
    gen = torch.Generator().manual_seed(0)
    steps = [speculative_step(p, q, draft_tokens=torch.tensor([0]), generator=gen) for _ in range(4000)]
    accepted = [s for s in steps if s.accepted == 1]
    assert all(s.tokens == [0, 2] for s in accepted)
    assert all(s.tokens == [1] for s in steps if s.accepted == 0)
    assert abs(len(accepted) / len(steps) - 0.2) < 0.02
    assert steps[0].ratios == pytest.approx([0.2])


# ---- standardize ---------------------------------------------------------------------------
def test_sample_draws_the_law_of_its_weights_and_never_a_zero():
    """The CDF inversion of ``sample``: 40,000 draws from a 7-token law with zeros (first, middle,
    last) and unnormalised weights; TV to the law within the sampling noise (E[TV] ~0.006)."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 5.5, 0.0])
    law = weights / weights.sum()
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(7)
    for _ in range(40_000):
        counts[sample(weights, gen)] += 1
    assert counts[law == 0].sum() == 0
    assert 0.5 * (counts / counts.sum() - law).abs().sum() < 0.015
    one_hot = torch.zeros(1, 49_152)
    one_hot[0, 49_151] = 1.0  # the last token, in a [1, V] row
    assert {sample(one_hot, gen) for _ in range(50)} == {49_151}


def test_temperature_zero_is_one_hot_argmax_first_max():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    probs = standardize(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("path", ["native", "torch"])
def test_temperature_zero_takes_the_first_maximum_on_tied_vocabulary_rows(path, monkeypatch):
    """bf16 logits tie at the maximum (rounded rows more so): the native top-1 and the fallback
    both pick torch.argmax's first maximum, row by row and for a [V] row alone."""
    if path == "native" and not native.AVAILABLE:
        pytest.skip("native kernels not built")
    if path == "torch":
        monkeypatch.setattr(native, "topk", lambda x, k: None)
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 49152, generator=gen) * 3).to(torch.bfloat16)
    logits[1:4] = logits[1:4].float().round().clamp(max=2.0).to(torch.bfloat16)  # thousands tied at the top
    logits[4, [7, 900, 49151]] = 40.0  # three tied leaders
    want = logits.float().argmax(-1)
    assert int((logits[1].float() == logits[1].float().max()).sum()) > 1
    probs = standardize(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs.argmax(-1), want) and torch.equal(probs.sum(-1), torch.ones(6))
    assert int(want[4]) == 7
    assert torch.equal(standardize(logits[2], SamplingParams(temperature=0.0)), probs[2])


def test_temperature_scales_logits():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    probs = standardize(logits, SamplingParams(temperature=0.6))
    assert torch.allclose(probs, torch.softmax(logits / 0.6, dim=-1))
    assert torch.allclose(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_the_k_largest(k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(5, 12, generator=gen)
    probs = standardize(logits, SamplingParams(temperature=1.0, top_k=k))
    for row, lg in zip(probs, logits):
        kept = set(torch.nonzero(row).flatten().tolist())
        assert kept == set(torch.topk(lg, k).indices.tolist())
        full = torch.softmax(lg, -1)
        idx = sorted(kept)
        assert torch.allclose(row[idx], full[idx] / full[idx].sum())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_minimal_nucleus(top_p):
    gen = torch.Generator().manual_seed(int(top_p * 1000))
    logits = torch.randn(20, 10, generator=gen) * 2
    probs = standardize(logits, SamplingParams(temperature=1.0, top_p=top_p))
    for row, lg in zip(probs, logits):
        full = torch.softmax(lg, -1)
        order = torch.argsort(full, descending=True)
        cum = torch.cumsum(full[order], 0)
        n_keep = int((cum < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p
        nucleus = set(order[:n_keep].tolist())
        assert set(torch.nonzero(row).flatten().tolist()) == nucleus
        assert float(full[order[: n_keep - 1]].sum()) < top_p <= float(cum[n_keep - 1]) + 1e-6
        idx = sorted(nucleus)
        assert torch.allclose(row[idx], full[idx] / full[idx].sum())


def test_top_k_then_top_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    probs = standardize(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    # top-3 renormalized: 4/9, 3/9, 2/9; nucleus for 0.7: 4/9 + 3/9 = 0.78 >= 0.7
    assert probs.tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])


# ---- the top-p fast path against the full sort it replaced -----------------------------------
def _full_sort_standardize(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k then top-p by sorting the whole vocabulary (the implementation before the fast
    path, kept here as the reference)."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    sorted_p = sorted_p.double()  # the fast path's prefix sums are float64 too
    drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.softmax(x.masked_fill(drop, float("-inf")), dim=-1)


@pytest.fixture(params=["native", "torch"])
def top_p_path(request, monkeypatch):
    """Top-p by the native radix select, or by the PyTorch fallback (no native kernels)."""
    if request.param == "native" and not native.AVAILABLE:
        pytest.skip("native kernels not built")
    if request.param == "torch":
        monkeypatch.setattr(native, "top_p_", lambda probs, top_p: False)
    return request.param


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (huge nucleus), heavy-tailed, peaked
@pytest.mark.parametrize("params", [
    SamplingParams(1.0, top_p=0.9), SamplingParams(0.7, top_p=0.5), SamplingParams(1.3, top_p=0.999),
    SamplingParams(1.0, top_p=0.05), SamplingParams(1.0, top_k=50, top_p=0.9),
    SamplingParams(0.8, top_k=2000, top_p=0.95)])
def test_top_p_fast_path_equals_the_full_sort(scale, params, top_p_path):
    """Same kept set exactly and the same probabilities, on a 49k vocabulary, for single rows
    and for a verification batch."""
    gen = torch.Generator().manual_seed(int(scale * 100) + params.top_k)
    logits = torch.randn(6, 49152, generator=gen) * scale
    fast = standardize(logits, params)
    ref = _full_sort_standardize(logits, params)
    assert torch.equal(fast > 0, ref > 0)
    assert torch.allclose(fast, ref, atol=1e-7, rtol=1e-5)
    for row in range(2):  # one row at a time, as a draft calls it
        one = standardize(logits[row], params)
        assert torch.equal(one > 0, ref[row] > 0)


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=50), SamplingParams(0.7, top_k=50, top_p=0.9),
                                    SamplingParams(1.0, top_k=7, top_p=0.999)])
def test_ties_at_the_top_k_cut_are_kept_as_the_full_sort_keeps_them(params):
    """bf16-rounded logits (ties everywhere) and rows of different tie counts at the k-th value:
    every token tied at the cut is a candidate (as masking the whole vocabulary keeps them);
    without top-p the same probabilities as that reference; with it a most-probable prefix of
    the candidates whose mass first reaches top_p (tied tokens at that boundary may come in
    either order), renormalised."""
    gen = torch.Generator().manual_seed(params.top_k)
    logits = (torch.randn(5, 49152, generator=gen) * 3).to(torch.bfloat16).float()
    logits[1:3] = logits[1:3].round()  # many more ties at the cut
    x = logits / params.temperature
    kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
    ties = (x >= kth).sum(-1)
    assert (ties > params.top_k).sum() >= 3 and len(set(ties.tolist())) >= 3  # mostly ties, unequal
    fast = standardize(logits, params)
    assert torch.equal(standardize(logits[1], params), fast[1])  # a row alone: the same bits
    if params.top_p >= 1.0:
        ref = _full_sort_standardize(logits, params)
        assert torch.equal(fast > 0, ref > 0) and torch.allclose(fast, ref, atol=1e-7, rtol=1e-5)
        return
    for row in range(5):
        cand = torch.nonzero(x[row] >= kth[row]).flatten()
        p = torch.softmax(x[row, cand], -1).double()
        kept = torch.nonzero(fast[row]).flatten()
        assert set(kept.tolist()) <= set(cand.tolist())
        inside = p[torch.isin(cand, kept)]
        outside = p[~torch.isin(cand, kept)]
        assert outside.numel() == 0 or float(inside.min()) >= float(outside.max())  # a most-probable prefix
        assert float(inside.sum() - inside.min()) < params.top_p <= float(inside.sum()) + 1e-9
        assert torch.allclose(fast[row, cand[torch.isin(cand, kept)]].double(), inside / inside.sum(), rtol=1e-5)


def test_top_p_fast_path_with_tied_probabilities():
    """Ties at the nucleus boundary: the kept set is a most-probable prefix with the right mass,
    whichever of the tied tokens the order put first."""
    logits = torch.zeros(49152)
    logits[:10] = 5.0  # ten tied leaders
    for top_p in (0.3, 0.9):
        probs = standardize(logits, SamplingParams(1.0, top_p=top_p))
        full = torch.softmax(logits, -1)
        kept = probs > 0
        assert float(full[kept].sum()) >= top_p
        assert float(full[kept].sum() - full[kept].min()) < top_p
        assert float(full[kept].min()) >= float(full[~kept].max())


def _stable_nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort by decreasing probability, ties lower index first; drop a token when
    the float64 mass strictly before it reaches top_p; renormalise."""
    probs = torch.softmax(x, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    sorted_p = probs.gather(-1, order).double()
    drop = torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, torch.cumsum(sorted_p, -1) - sorted_p >= top_p)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 1 - 1e-12])
def test_top_p_keeps_ties_lower_index_first(top_p, top_p_path):
    """Both paths against the definition, exactly in which tokens they keep: bf16 and
    rounded logits (ties everywhere, at the boundary too), rows whose tail underflows to exact
    zeros, a vocabulary that is no multiple of the vector width, one row alone."""
    gen = torch.Generator().manual_seed(int(top_p * 1e4))
    logits = torch.randn(6, 49157, generator=gen) * torch.tensor([[0.5], [3.0], [3.0], [12.0], [40.0], [3.0]])
    logits = logits.to(torch.bfloat16).float()
    logits[2] = logits[2].round()  # ~20 distinct values: long runs of ties at any boundary
    logits[5, 100:] = -1e4  # 100 tokens hold all the mass
    ref = _stable_nucleus(logits, top_p)
    got = standardize(logits, SamplingParams(1.0, top_p=top_p))
    assert torch.equal(got > 0, ref > 0)
    assert torch.allclose(got, ref, atol=1e-7, rtol=1e-5)
    assert torch.equal(standardize(logits[2], SamplingParams(1.0, top_p=top_p)), got[2])
    assert bool((torch.softmax(logits[4], -1) == 0).any())  # row 4: a tail of exact zeros
