"""The host's roofline for a k-token forward, measured in the benchmark's own run: read
bandwidth, GEMM peak, and a model's bytes and FLOPs (bench_verify.py, bench_verify_tp.py)."""

from __future__ import annotations

import time

import torch

from real.model.decoder import Transformer
from specbed_kernels import native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------ the roofline
PROBE_BUFFERS: dict[str, torch.Tensor] = {}


def read_bandwidth(threads: int, repeats: int = 3) -> float:
    """Best read rate (bytes/s) of 512 MB by torch's sum and the native stream, ``threads`` cores."""
    x = PROBE_BUFFERS.setdefault("x", torch.ones(128 << 20))
    best = float("inf")
    torch.set_num_threads(threads)
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
        if native._LIB is not None:
            start = time.perf_counter()
            native._LIB.sb_read_sum(x.data_ptr(), x.numel(), threads)
            best = min(best, time.perf_counter() - start)
    torch.set_num_threads(1)
    return x.numel() * 4 / best


def gemm_peak(dtype: torch.dtype, threads: int = 1) -> dict[str, float]:
    """FLOP/s of a 2048^3 torch.matmul in ``dtype`` and in fp32, and of the native FMA probe."""
    torch.set_num_threads(threads)
    out = {}
    for name, dt in (("torch_" + str(dtype).split(".")[-1], dtype), ("torch_float32", torch.float32)):
        a, b = torch.randn(2048, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        a @ b
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * 2048 ** 3 / best
    if native._LIB is not None:
        out["native_fma"] = native._LIB.sb_fma_peak(0.3) * 1e9 * threads
    torch.set_num_threads(1)
    return out


def model_cost(model: Transformer, k: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one k-token forward after ``context`` cached tokens."""
    a, size = model.args, model.dtype.itemsize
    gemm = 0
    for layer in model.layers:
        gemm += sum(w.numel() for w in (layer.attention.wqkv, layer.attention.wo,
                                        layer.feed_forward.w13, layer.feed_forward.w2))
    gemm += model.output.numel()
    kv_bytes = a.n_layers * 2 * a.n_kv_heads * a.head_dim * (context + k) * size
    attn_flops = 4 * (context + k) * a.n_heads * a.head_dim * a.n_layers * k
    return gemm * size + kv_bytes, 2 * gemm * k + attn_flops
