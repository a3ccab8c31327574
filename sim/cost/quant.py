"""Weight formats: how many bytes a weight matrix occupies and which dtype its GEMM runs in.

Used by the roofline cost model. Names match ``testbed.config.QUANTS``.

- fp32 / bf16 / fp16: plain 4 / 2 / 2 bytes per weight.
- int8: W8A8 (SmoothQuant-style), 1 byte per weight + one fp16 scale per output channel;
  the GEMM runs on int8 tensor cores.
- int4_awq: AWQ, 4-bit weights with an fp16 scale and an fp16 zero point per group of 128 input
  channels (0.5 + 4/128 bytes per weight); dequantized to bf16 inside the GEMM (SwiftSpec §5.1).
- q4_1: GGUF Q4_1 blocks of 32 weights = fp16 scale + fp16 min + 16 bytes of nibbles = 20 bytes;
  the real backend dequantizes to fp32 and computes in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AWQ_GROUP = 128
Q4_1_BLOCK = 32
Q4_1_BLOCK_BYTES = 20


@dataclass(frozen=True)
class QuantSpec:
    compute_dtype: str  # key into GpuConfig.tflops for the GEMMs
    act_bytes: int  # activations and KV cache element size


QUANT_SPECS: dict[str, QuantSpec] = {
    "fp32": QuantSpec("fp32", 4),
    "bf16": QuantSpec("bf16", 2),
    "fp16": QuantSpec("fp16", 2),
    "int8": QuantSpec("int8", 2),
    "int4_awq": QuantSpec("bf16", 2),
    "q4_1": QuantSpec("fp32", 4),
}


def spec(quant: str) -> QuantSpec:
    try:
        return QUANT_SPECS[quant]
    except KeyError:
        raise ValueError(f"quant={quant!r} is not allowed: one of {', '.join(QUANT_SPECS)}") from None


def weight_bytes(quant: str, k: int, n: int) -> float:
    """Bytes of a k (input) x n (output) weight matrix stored in `quant`."""
    if quant == "fp32":
        return 4.0 * k * n
    if quant in ("bf16", "fp16"):
        return 2.0 * k * n
    if quant == "int8":
        return 1.0 * k * n + 2.0 * n
    if quant == "int4_awq":
        return 0.5 * k * n + 4.0 * math.ceil(k / AWQ_GROUP) * n
    if quant == "q4_1":
        return Q4_1_BLOCK_BYTES * math.ceil(k / Q4_1_BLOCK) * n
    spec(quant)  # raises with the allowed names
    raise AssertionError


def bytes_per_weight(quant: str, k: int = 4096) -> float:
    """Average bytes per weight (for a typical input dimension k; scales amortize over k)."""
    return weight_bytes(quant, k, 1) / k


def head_quant(quant: str) -> str:
    """Format of the embedding table and LM head: SwiftSpec keeps them in bf16 when the
    transformer layers are quantized; fp32 models (and the fp32-dequantized GGUF) stay fp32."""
    if spec(quant).act_bytes == 4:
        return "fp32"
    return "fp16" if quant == "fp16" else "bf16"
