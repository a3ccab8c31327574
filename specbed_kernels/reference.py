"""PyTorch reference implementations of the model's latency-critical ops.

Every op here is the definition a faster kernel (Triton, a fused CPU kernel) must match; the
model calls them through ``kernels`` (see ``specbed_kernels/__init__.py``) so a replacement can be
registered without touching the model.

Layouts:
- activations ``[B, T, dim]``; per-head projections ``[B, T, H, D]`` (before attention) and
  ``[B, H, T, D]`` for attention, K/V ``[B, H_kv, S, D]`` (S = keys, e.g. the KV cache prefix).
- RoPE tables ``cos``/``sin_signed`` ``[T, D]`` (see ``rope_tables``), already gathered at the
  tokens' position ids, in the "rotate half" layout of HF Llama.
- attention masks are boolean, True = may attend: ``[T, S]`` (shared by batch and heads) or
  ``[B, 1, T, S]``; T and S may differ (a token tree verified against a cached prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T, weight ``[out, in]`` (no bias: Llama has none)."""
    return F.linear(x, weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, statistics in fp32, as HF Llama: weight * norm(x).to(x.dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return weight * normed


def rope_tables(
    head_dim: int,
    max_positions: int,
    *, theta: float,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """RoPE tables ``cos, sin_signed [max_positions, head_dim]`` (computed in fp64).

    Rotate-half layout (HF Llama): dims i and i + D/2 form a rotation pair with angle
    ``pos * inv_freq[i]``. ``sin_signed`` has its first half negated, so that the rotation is
    ``x * cos + x.roll(D/2) * sin_signed`` (= HF's ``x * cos + rotate_half(x) * sin``) with one
    fewer op. ``scaling``: HF ``rope_scaling``; "llama3" (Llama 3.1+) or default/None.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling or {})
    elif kind not in ("default", None):
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin_signed = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.to(dtype), sin_signed.to(dtype)


def _llama3_scaled(inv_freq: Tensor, s: dict) -> Tensor:
    # Llama 3.1 long-context RoPE: long wavelengths slowed by `factor`, short ones kept, a
    # smooth blend between the two wavelength thresholds.
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return torch.where(mid, blended, out)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, D]`` by its positions' angles; tables ``[T, D]`` from ``rope_tables``
    gathered at the tokens' position ids."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1); the sign lives in sin_signed
    return torch.addcmul(x * cos[:, None, :], rotated, sin_signed[:, None, :])


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Scaled dot-product attention with grouped K/V heads and an arbitrary boolean mask.

    q ``[B, Hq, T, D]``, k/v ``[B, Hkv, S, D]`` with Hq a multiple of Hkv (query head h uses
    K/V head h // (Hq // Hkv), as HF's repeat_kv), mask ``[T, S]`` or ``[B, 1, T, S]`` bool
    (True = attend) or None (every query sees every key). Returns ``[B, Hq, T, D]``.
    """
    # enable_gqa maps query head h to K/V head h // (Hq // Hkv) without copying K/V (and was
    # faster here than folding the query groups into the query length).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    """silu(x @ w_gate.T) * (x @ w_up.T): the Llama MLP before its down projection."""
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def swiglu_fused(x: Tensor, w_gate_up: Tensor) -> Tensor:
    """swiglu with gate and up weights concatenated once at load: ``[2 * ffn, dim]``."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def decode_layers(model, lo: int, hi: int, h: Tensor, *, cos: Tensor, sin: Tensor, pos: Tensor,
                  mask: Tensor | None, kv_len: int) -> Tensor | None:
    """A fused kernel for a run of decoder layers, or None: the model then runs its layers op by
    op through the ops above, which *are* the reference definition (``real.model.decoder``).
    A replacement (``specbed_kernels.native.decode_layers``) returns the layers' output hidden states,
    or None for any case it does not cover."""
    return None
