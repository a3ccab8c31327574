"""kernels: reference ops against naive definitions, the CPU GEMM path against F.linear, and
the op registry."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import specbed_kernels as kernels
from specbed_kernels import cpu, reference


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_matches_definition() -> None:
    x, w = torch.randn(2, 3, 16, generator=gen(0)), torch.randn(16, generator=gen(1))
    expected = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-5), expected)
    got16 = reference.rms_norm(x.bfloat16(), w.bfloat16(), 1e-5)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), expected, atol=0.05, rtol=0.02)


def test_rope_is_a_rotation_of_each_half_pair() -> None:
    d, theta = 8, 10000.0
    cos, sin = reference.rope_tables(d, 32, theta=theta)
    x = torch.randn(1, 3, 2, d, generator=gen(2))  # [B, T, H, D]
    pos = torch.tensor([0, 5, 31])
    got = reference.apply_rope(x, cos[pos], sin[pos])
    # complex form: pair (x_i, x_{i+D/2}) rotated by pos * theta^(-2i/D)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = z * torch.polar(torch.ones(3, d // 2, dtype=torch.float64), pos[:, None] * freqs)[None, :, None]
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1).float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))


def naive_attention(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("t,s,hq,hkv", [(1, 9, 6, 2), (5, 12, 6, 3), (4, 4, 4, 4)])
def test_attention_with_gqa_and_non_square_masks(t: int, s: int, hq: int, hkv: int) -> None:
    q = torch.randn(2, hq, t, 16, generator=gen(3))
    k, v = torch.randn(2, hkv, s, 16, generator=gen(4)), torch.randn(2, hkv, s, 16, generator=gen(5))
    mask = torch.rand(t, s, generator=gen(6)) > 0.4
    mask[:, 0] = True  # every query sees at least one key
    for m in (None, mask, mask.expand(2, 1, t, s)):
        torch.testing.assert_close(reference.attention(q, k, v, m), naive_attention(q, k, v, m),
                                   atol=1e-5, rtol=1e-5)


def test_swiglu_fused_equals_separate_weights() -> None:
    x = torch.randn(1, 3, 16, generator=gen(7))
    wg, wu = torch.randn(24, 16, generator=gen(8)), torch.randn(24, 16, generator=gen(9))
    expected = F.silu(x @ wg.T) * (x @ wu.T)
    torch.testing.assert_close(reference.swiglu(x, wg, wu), expected)
    torch.testing.assert_close(reference.swiglu_fused(x, torch.cat([wg, wu])), expected)
    torch.testing.assert_close(kernels.swiglu_fused(x, torch.cat([wg, wu])), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu.AVAILABLE, reason="oneDNN linear not available in this torch build")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_onednn_linear_matches_f_linear(rows: int) -> None:
    x, w = torch.randn(1, rows, 576, generator=gen(10)), torch.randn(960, 576, generator=gen(11))
    torch.testing.assert_close(cpu.linear(x, w), F.linear(x, w), atol=2e-4, rtol=1e-4)
    xt = torch.randn(1, 2 * rows, 576, generator=gen(12))[:, ::2]  # strided input
    torch.testing.assert_close(cpu.linear(xt, w), F.linear(xt, w), atol=2e-4, rtol=1e-4)
    # bf16 goes to oneDNN where this CPU supports it, else to the reference: close either way
    torch.testing.assert_close(cpu.linear(x.bfloat16(), w.bfloat16()).float(), F.linear(x, w),
                               atol=0.5, rtol=0.05)


def test_registry_dispatches_and_resets() -> None:
    calls = []

    def fake(q, k, v, mask=None):
        calls.append(q.shape)
        return reference.attention(q, k, v, mask)

    try:
        kernels.register("attention", fake)
        assert kernels.get("attention") is fake
        from tests.helpers.real_models import tiny

        tiny()(torch.tensor([[1, 2, 3]]), 0)
        assert len(calls) == 4  # once per layer of the tiny model
        kernels.use_reference()
        assert kernels.linear is reference.linear
    finally:
        kernels.reset()
    assert kernels.get("attention") is kernels.defaults()["attention"]
    with pytest.raises(KeyError, match="unknown kernel op"):
        kernels.register("conv", fake)


@pytest.mark.parametrize("t,s,hq,hkv", [(1, 9, 6, 2), (5, 12, 6, 3), (40, 50, 4, 2)])
def test_cpu_attention_matches_reference(t: int, s: int, hq: int, hkv: int) -> None:
    q = torch.randn(2, hq, t, 16, generator=gen(13))
    k, v = torch.randn(2, hkv, s, 16, generator=gen(14)), torch.randn(2, hkv, s, 16, generator=gen(15))
    mask = torch.rand(t, s, generator=gen(16)) > 0.4
    mask[:, 0] = True
    for m in (None, mask, mask.expand(2, 1, t, s)):
        torch.testing.assert_close(cpu.attention(q, k, v, m), naive_attention(q, k, v, m), atol=1e-5, rtol=1e-5)
    # strided K/V, as sliced from a KV cache
    kc, vc = torch.randn(2, hkv, 3 * s, 16, generator=gen(17)), torch.randn(2, hkv, 3 * s, 16, generator=gen(18))
    torch.testing.assert_close(cpu.attention(q, kc[:, :, :s], vc[:, :, :s], mask),
                               naive_attention(q, kc[:, :, :s], vc[:, :, :s], mask), atol=1e-5, rtol=1e-5)
