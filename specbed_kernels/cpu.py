"""CPU versions of the ops where the reference is slow on CPU: GEMMs through oneDNN instead of
the BLAS behind ``F.linear``, and attention over few queries as two explicit matmuls.

Why: on this project's x86 CPUs (AMD EPYC) ``F.linear`` goes to MKL, whose matrix-vector
path reaches ~15 GB/s, less than half of the memory bandwidth; oneDNN's matmul (the op PyTorch's
own compiler uses for CPU linears, ``mkldnn::_linear_pointwise``) streams the same weights at
~35 GB/s, so batch-1 decode, which is bound by reading weights, runs ~2x faster
(benchmarks/bench_decode.py). Results equal ``F.linear``'s up to summation order (~1e-4).

Used only for CPU fp32/bf16 tensors whose dtype oneDNN supports on this CPU; anything else falls
back to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specbed_kernels import reference

_OP = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _probe(dtype: torch.dtype) -> bool:
    # The op is internal to PyTorch: use it only if it exists here and agrees with F.linear in
    # this dtype. Probed per dtype because oneDNN has no bf16 inner product on CPUs without
    # AVX512 (an AVX2-only EPYC raises "could not create a primitive descriptor").
    if _OP is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 64).to(dtype), torch.randn(32, 64).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 0.1
        return bool(torch.allclose(_OP(x, w, None, "none", [], "").float(), F.linear(x, w).float(),
                                   atol=tol, rtol=tol))
    except (RuntimeError, NotImplementedError):
        return False


DTYPES: frozenset[torch.dtype] = frozenset(d for d in (torch.float32, torch.bfloat16) if _probe(d))
AVAILABLE: bool = torch.float32 in DTYPES


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T via oneDNN on CPU for the dtypes it supports here, else the reference."""
    if x.device.type == "cpu" and x.dtype in DTYPES and x.dtype == weight.dtype:
        return _OP(x, weight, None, "none", [], "")
    return reference.linear(x, weight)


# Below this many query rows per K/V head, attention is done as two small matmuls: for decode
# (and short verifications) that beats SDPA's flash kernel on a strided KV-cache slice (~12 vs
# ~22 us per layer here); long prefills keep SDPA, which never materialises the score matrix.
_SMALL_ATTENTION_ROWS = 32


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """``reference.attention`` (same layouts), computed explicitly for few queries on CPU."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    if q.device.type != "cpu" or rep * t > _SMALL_ATTENTION_ROWS:
        return reference.attention(q, k, v, mask)
    # the `rep` query heads sharing a K/V head become `rep * t` rows of it: no K/V copies
    scores = torch.matmul(q.reshape(b, hkv, rep * t, d), k.transpose(-1, -2)).mul_(d ** -0.5)
    if mask is not None:
        keep = mask.repeat(*([1] * (mask.dim() - 2)), rep, 1)  # rows ordered (head in group, t)
        scores = scores.masked_fill_(keep.logical_not(), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq, t, d)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    return F.silu(linear(x, w_gate)).mul_(linear(x, w_up))


def swiglu_fused(x: Tensor, w_gate_up: Tensor) -> Tensor:
    gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
