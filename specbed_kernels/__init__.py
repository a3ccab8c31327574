"""Latency-critical operators, dispatched by name so a faster kernel can replace a reference op.

The model calls ``specbed_kernels.attention(...)``, ``specbed_kernels.rms_norm(...)`` etc. as module attributes,
looked up at call time, so ``specbed_kernels.register("attention", my_triton_attention)`` takes effect
everywhere at once. A replacement must accept the reference's arguments and layouts.

Defaults: the PyTorch references of ``specbed_kernels/reference.py``, except on CPU (``specbed_kernels/cpu.py``):
the GEMM ops (linear, swiglu) use oneDNN where available (~2x faster batch-1 decode than
MKL's GEMV) and attention over few queries is two explicit matmuls (faster than SDPA there).
Where the native kernels build (``specbed_kernels/native.py``: a C++ compiler; x86 AVX-512 or AVX2+FMA,
or any CPU with a slower generic path), GEMVs over <= 8 tokens stream weights with a
hand-written kernel and ``decode_layers`` runs a whole run of decoder layers in one call (decode
and short verifications at batch 1); everything else keeps the ops above.
``reset()`` restores these defaults, ``use_reference()`` the plain references everywhere.
Tensor parallelism (real/model/tp.py) sums partial outputs with a backend of ``specbed_kernels.allreduce``
(gloo, or the same-host shared-memory one of ``specbed_kernels/shm_allreduce.cpp``); ``decode_layers``
calls it between the layers it fuses, or steps aside when it cannot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# torch's CPU allocator puts allocations of >= 2 MB on transparent huge pages when this is set
# before its first allocation (a forward that streams weights from 4 KB pages took 1.3-1.45x as
# long); testbed sets it too, for processes that never import the operators
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from specbed_kernels import cpu, native, reference  # noqa: E402  (after the allocator setting)

OPS: tuple[str, ...] = (
    "linear",
    "rms_norm",
    "apply_rope",
    "attention",
    "swiglu",
    "swiglu_fused",
    "decode_layers",
)


def defaults() -> dict[str, Callable]:
    """The implementation each op gets unless one is registered."""
    ops = {name: getattr(reference, name) for name in OPS}
    if cpu.AVAILABLE:
        ops.update(linear=cpu.linear, swiglu=cpu.swiglu, swiglu_fused=cpu.swiglu_fused)
    ops.update(attention=cpu.attention)  # falls back to the reference off CPU / for long inputs
    if native.AVAILABLE:  # each falls back to the ops above where it does not apply
        ops.update(linear=native.linear, swiglu_fused=native.swiglu_fused,
                   decode_layers=native.decode_layers)
    return ops


_DEFAULTS = defaults()
linear = _DEFAULTS["linear"]
rms_norm = _DEFAULTS["rms_norm"]
apply_rope = _DEFAULTS["apply_rope"]
attention = _DEFAULTS["attention"]
swiglu = _DEFAULTS["swiglu"]
swiglu_fused = _DEFAULTS["swiglu_fused"]
decode_layers = _DEFAULTS["decode_layers"]


def preferred_dtype(device: str = "cpu") -> str:
    """What ``real.dtype=auto`` runs: bf16 on a GPU and on a CPU where the native kernels run, else
    fp32 (PyTorch's bf16 matmul on a CPU without AVX512-BF16 runs at < 1 GFLOP/s). bf16 reads half
    the bytes: on the AVX2 host a 1-4-token forward takes about half the fp32 time (0.5-0.6x), an
    8-token one ~0.8x, and at 12-16 tokens, compute bound in both dtypes, about the same
    (``benchmarks/bench_verify.py``); the decode steps and verification windows that speculative
    decoding runs are mostly in the first range."""
    if device != "cpu":
        return "bf16"
    return "bf16" if native.AVAILABLE else "fp32"


def register(name: str, fn: Callable) -> None:
    """Use ``fn`` for op ``name`` from now on (e.g. a Triton kernel on GPU).

    The default ``decode_layers`` fuses the default ops: registering any other op switches it
    to the reference (no fusion), so that the replacement really runs in every layer."""
    if name not in OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {', '.join(OPS)}")
    globals()[name] = fn
    if name != "decode_layers" and globals()["decode_layers"] is _DEFAULTS["decode_layers"]:
        globals()["decode_layers"] = reference.decode_layers


def get(name: str) -> Callable:
    """The implementation currently registered for op ``name``."""
    if name not in OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {', '.join(OPS)}")
    return globals()[name]


def reset() -> None:
    """Restore every op to its default (see the module docstring)."""
    globals().update(_DEFAULTS)


def use_reference() -> None:
    """Plain PyTorch references for every op (e.g. to compare against the defaults)."""
    for name in OPS:
        globals()[name] = getattr(reference, name)


@contextmanager
def reference_kernels() -> Iterator[None]:
    """The PyTorch reference ops inside the block (differentiable: training; the native CPU
    kernels are inference-only), restoring whatever was registered before."""
    saved = {name: get(name) for name in OPS}
    use_reference()
    try:
        yield
    finally:
        for name, fn in saved.items():
            globals()[name] = fn
