"""Roofline latency of one transformer forward on a tensor-parallel GPU group.

A forward is a list of ``Op``s (per layer: norm, QKV GEMM, attention over the KV cache, O GEMM,
all-reduce, norm, gate/up GEMM + activation, down GEMM, all-reduce; per forward: embedding, final
norm, LM head, logits gather, sampling, host overhead). One instance of an op takes

    max(HBM bytes / achieved bandwidth, FLOPs / achieved peak) + kernels * launch_us + fixed

where ``fixed`` is the α–β time of a collective or attention's split-KV synchronisation.

What does not shrink with the TP degree: every kernel's minimum time (``launch_us`` times the
kernels of a layer times the layers: a per-forward fixed cost that grows with the model's depth),
the all-reduce latency (growing by ``allreduce_per_peer_us`` per GPU), and the per-forward
synchronisation of the TP group's workers (``tp_sync_us`` per GPU beyond the first: the serving
framework hands every forward's inputs to each worker and waits for all of them). The last one is
what makes a small model slower on 4 GPUs than on 2 (seed 002 §1, Table 1). Bytes and
FLOPs are affine in the context length, so a forward is a convex piecewise-affine function of it
(``sim.cost.roofline`` uses that to answer in O(1)).

Tensor parallelism shards heads, KV heads and the FFN over ``tp`` GPUs, zero-padding when ``tp``
does not divide them (SwiftSpec §4 "arbitrary tensor parallelism"); fewer KV heads than GPUs are
replicated (GQA/MQA). The constants below are calibrated in ``sim.cost.roofline_calibration``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sim.cost.base import ForwardCost
from sim.cost.quant import head_quant, spec, weight_bytes
from testbed.config import HardwareConfig, ModelConfig

# Fitted by least squares on log error to SwiftSpec's H800 per-kernel times for standard kernels
# (seed 002: Table 3 and the vLLM/TRT-LLM/FlashAttention columns of Table 7, weighted equally),
# together with gpu.launch_us = 4.76 and allreduce_alpha_us = 9.22 in conf/hardware/h800x8.yaml.
# RMS error 14% on Table 3, 20% on Table 7; data and per-point errors in sim.cost.roofline_calibration.
HBM_EFFICIENCY = 0.6545  # achieved fraction of datasheet HBM bandwidth
ATTENTION_SYNC_US = 3.03  # split-KV attention: fixed time beyond its 3 kernels (sync, reduction)
ALLREDUCE_PER_PEER_US = 0.54  # one-shot all-reduce: latency added by each GPU beyond 2
# Fitted to SwiftSpec's two whole-forward figures (§5.3 Llama-3B TP4 3.54 ms; §1 ~30 s for ~3000
# tokens of int4 Llama-70B on 8 H800 ≈ 10 ms/token) beside TP_SYNC_US, errors -2% / +6% (without
# the TP sync: 1448 us, -1% / +2%): host-side graph launch, sampling and the device-to-host sync
# of the result, once per forward (on the last stage).
FORWARD_OVERHEAD_US = 969.9
# Per-forward synchronisation of the TP group, per GPU beyond the first. Set to the smallest value
# that reproduces seed 002 §1 (at batch 8 a Llama-3B gets slower from TP 2 to TP 4; the margin is
# sim.cost.roofline_calibration.TP_SHAPE_MARGIN), then FORWARD_OVERHEAD_US refitted beside it.
TP_SYNC_US = 137.9
# Assumed, not fitted (the calibration data are memory-bound): dense GEMMs reach ~70% of the
# datasheet peak, FlashAttention-2 kernels ~50% (FA3 paper: FA2 35-50% on H100, FA3 up to 75%).
GEMM_FLOP_EFFICIENCY = 0.70
ATTENTION_FLOP_EFFICIENCY = 0.50


@dataclass(frozen=True)
class Calibration:
    hbm_efficiency: float = HBM_EFFICIENCY
    gemm_flop_efficiency: float = GEMM_FLOP_EFFICIENCY
    attention_flop_efficiency: float = ATTENTION_FLOP_EFFICIENCY
    attention_sync_us: float = ATTENTION_SYNC_US
    allreduce_per_peer_us: float = ALLREDUCE_PER_PEER_US
    forward_overhead_us: float = FORWARD_OVERHEAD_US
    tp_sync_us: float = TP_SYNC_US


DEFAULT_CALIBRATION = Calibration()
BUCKETS = ("weights", "attention", "allreduce", "other")


@dataclass(frozen=True)
class Op:
    """One kernel group, executed `count` times per forward. Bytes/FLOPs = x0 + x_ctx * context."""

    name: str
    bucket: str  # one of BUCKETS; kernel launches always go to `launch`
    count: int
    kernels: int
    bw: float  # achieved HBM bytes/s
    peak: float  # achieved FLOP/s
    bytes0: float = 0.0
    bytes_ctx: float = 0.0
    flops0: float = 0.0
    flops_ctx: float = 0.0
    fixed_s: float = 0.0
    link_bytes: float = 0.0

    def roof_s(self, context: float) -> float:
        return max((self.bytes0 + self.bytes_ctx * context) / self.bw,
                   (self.flops0 + self.flops_ctx * context) / self.peak)

    def seconds(self, context: float, launch_s: float) -> float:
        """Time of one instance."""
        return self.roof_s(context) + self.kernels * launch_s + self.fixed_s


@dataclass(frozen=True)
class RooflineForward(ForwardCost):
    """ForwardCost plus the traffic behind it (whole forward, per GPU)."""

    hbm_bytes: float = 0.0
    link_bytes: float = 0.0
    flops: float = 0.0
    memory_s: float = 0.0  # sum over ops of bytes / achieved bandwidth
    compute_s: float = 0.0  # sum over ops of FLOPs / achieved peak


def peak_flops(hw: HardwareConfig, dtype: str) -> float:
    if dtype not in hw.gpu.tflops:
        raise ValueError(f"hardware.gpu.tflops.{dtype} is missing: {hw.name} lists "
                         f"{', '.join(hw.gpu.tflops) or 'nothing'}")
    return hw.gpu.tflops[dtype] * 1e12


def allreduce_s(hw: HardwareConfig, tp: int, nbytes: float, cal: Calibration, *,
                factor: float | None = None) -> float:
    """α–β one-shot all-reduce: α(n) = α₂ + per-peer·(n−2); β term 2(n−1)/n · bytes / NVLink."""
    if tp <= 1:
        return 0.0
    if hw.nvlink_gbps <= 0:
        raise ValueError(f"hardware.nvlink_gbps={hw.nvlink_gbps} is not allowed with tp={tp}: "
                         "a positive bandwidth")
    factor = 2 * (tp - 1) / tp if factor is None else factor
    alpha_us = hw.allreduce_alpha_us + cal.allreduce_per_peer_us * (tp - 2)
    return alpha_us * 1e-6 + factor * nbytes / (hw.nvlink_gbps * 1e9)


def _check(model: ModelConfig, hw: HardwareConfig, *, tp: int, tokens: int,
           layers: tuple[int, int] | None) -> tuple[int, int]:
    if model.kind not in ("transformer", "eagle"):
        raise ValueError(f"model.kind={model.kind!r} is not allowed here: transformer or eagle")
    if not 1 <= tp <= hw.gpus_per_node:  # the α–β all-reduce models NVLink inside one node
        raise ValueError(f"tp={tp} is not allowed: an integer in [1, {hw.gpus_per_node}] "
                         f"(GPUs per node of {hw.name})")
    if tokens < 1:
        raise ValueError(f"tokens={tokens} is not allowed: an integer >= 1")
    lo, hi = layers if layers is not None else (0, model.layers)
    if not 0 <= lo < hi <= model.layers:
        raise ValueError(f"layers={lo}:{hi} is not allowed: 0 <= lo < hi <= {model.layers}")
    return lo, hi


def forward_ops(model: ModelConfig, hw: HardwareConfig, *, tp: int, tokens: int,
                layers: tuple[int, int] | None = None,
                cal: Calibration = DEFAULT_CALIBRATION) -> list[Op]:
    """The ops of one forward of `tokens` tokens over layers [lo, hi) (None = all)."""
    lo, hi = _check(model, hw, tp=tp, tokens=tokens, layers=layers)
    q = spec(model.quant)
    act, t, h = q.act_bytes, tokens, model.hidden
    hd = model.head_dim or h // model.heads
    hp, kvp, fp = -(-model.heads // tp), -(-model.kv_heads // tp), -(-model.ffn // tp)
    bw = hw.gpu.hbm_gbps * 1e9 * cal.hbm_efficiency
    gemm_peak = peak_flops(hw, q.compute_dtype) * cal.gemm_flop_efficiency
    hq = head_quant(model.quant)  # activation dtype: attention math, embedding, LM head
    attn_peak = peak_flops(hw, hq) * cal.attention_flop_efficiency
    n = hi - lo

    def gemm(name: str, k: int, m: int, kernels: int, *, extra_bytes: float = 0.0,
             quant: str = model.quant, peak: float = gemm_peak, count: int = n,
             bucket: str = "weights") -> Op:
        return Op(name, bucket, count, kernels, bw, peak,
                  bytes0=weight_bytes(quant, k, m) + act * t * (k + m) + extra_bytes,
                  flops0=2.0 * t * k * m)

    def norm(name: str, count: int = n) -> Op:
        return Op(name, "other", count, 1, bw, gemm_peak,
                  bytes0=act * (3 * t * h + h), flops0=5.0 * t * h)

    def allreduce(name: str) -> Op:
        nbytes = t * h * act
        return Op(name, "allreduce", n, 0, bw, gemm_peak,
                  fixed_s=allreduce_s(hw, tp, nbytes, cal), link_bytes=2 * (tp - 1) / tp * nbytes)

    kv_per_pos = 2 * kvp * hd * act  # K and V of one position on one GPU
    ops = [norm("attn_norm"),
           # GEMM + rotary embedding
           gemm("qkv", h, (hp + 2 * kvp) * hd, 2, extra_bytes=2 * act * t * (hp + kvp) * hd),
           # KV append + split-KV attention + combine; mask over context + the new tokens
           Op("attention", "attention", n, 3, bw, attn_peak,
              bytes0=2 * kv_per_pos * t + 2 * act * t * hp * hd, bytes_ctx=kv_per_pos,
              flops0=4.0 * t * t * hp * hd, flops_ctx=4.0 * t * hp * hd,
              fixed_s=cal.attention_sync_us * 1e-6),
           gemm("o_proj", hp * hd, h, 1)]
    if tp > 1:
        ops.append(allreduce("allreduce_attn"))
    ops.append(norm("mlp_norm"))
    if model.mlp == "gelu":  # GPTBigCode: c_fc + GELU, then c_proj
        ops.append(gemm("gate_up", h, fp, 2, extra_bytes=2 * act * t * fp))
    else:  # SwiGLU: fused gate/up GEMM + silu(gate) * up
        ops.append(gemm("gate_up", h, 2 * fp, 2, extra_bytes=3 * act * t * fp))
    ops.append(gemm("down", fp, h, 1))
    if tp > 1:
        ops.append(allreduce("allreduce_mlp"))

    head_bytes = weight_bytes(hq, 1, 1)
    if lo == 0:
        ops.append(Op("embedding", "other", 1, 1, bw, gemm_peak, bytes0=t * h * (head_bytes + act)))
        if model.kind == "eagle":  # fc([embedding, feature]) before its one layer (real/model/eagle.py)
            ops.append(gemm("eagle_fc", 2 * h, h, 1, count=1))
    if hi == model.layers:
        # an eagle head with a draft vocabulary computes only its rows (a TP target's sharded
        # head serves whole on the real backend: real/model/eagle.py EagleHead.logits)
        rows = model.draft_vocab if model.kind == "eagle" and model.draft_vocab and tp == 1 else model.vocab
        vp = -(-rows // tp)
        head_peak = peak_flops(hw, hq) * cal.gemm_flop_efficiency
        ops += [norm("final_norm", 1),
                gemm("lm_head", h, vp, 1, quant=hq, peak=head_peak, count=1, bucket="other")]
        if tp > 1:
            nbytes = t * vp * tp * act
            ops.append(Op("logits_gather", "allreduce", 1, 0, bw, gemm_peak,
                          fixed_s=allreduce_s(hw, tp, nbytes, cal, factor=(tp - 1) / tp),
                          link_bytes=(tp - 1) / tp * nbytes))
        ops += [Op("sampling", "other", 1, 1, bw, gemm_peak, bytes0=4.0 * t * model.vocab,
                   flops0=5.0 * t * model.vocab),
                Op("host_overhead", "other", 1, 0, bw, gemm_peak,
                   fixed_s=cal.forward_overhead_us * 1e-6)]
        if tp > 1:
            ops.append(Op("tp_sync", "allreduce", 1, 0, bw, gemm_peak,
                          fixed_s=cal.tp_sync_us * (tp - 1) * 1e-6))
    return ops


def evaluate(ops: list[Op], hw: HardwareConfig, context: int) -> RooflineForward:
    """Sum the ops at one context length, by bucket."""
    launch_s = hw.gpu.launch_us * 1e-6
    by = dict.fromkeys(BUCKETS, 0.0)
    launch = hbm = link = flops = mem = comp = 0.0
    for op in ops:
        by[op.bucket] += op.count * (op.roof_s(context) + op.fixed_s)
        launch += op.count * op.kernels * launch_s
        b = op.bytes0 + op.bytes_ctx * context
        f = op.flops0 + op.flops_ctx * context
        hbm, link, flops = hbm + op.count * b, link + op.count * op.link_bytes, flops + op.count * f
        mem, comp = mem + op.count * b / op.bw, comp + op.count * f / op.peak
    total = sum(by.values()) + launch
    return RooflineForward(total_s=total, weights_s=by["weights"], attention_s=by["attention"],
                           allreduce_s=by["allreduce"], launch_s=launch, other_s=by["other"],
                           hbm_bytes=hbm, link_bytes=link, flops=flops, memory_s=mem, compute_s=comp)


def forward_cost(model: ModelConfig, hw: HardwareConfig, *, tp: int, tokens: int, context: int,
                 layers: tuple[int, int] | None = None,
                 cal: Calibration = DEFAULT_CALIBRATION) -> RooflineForward:
    """Modelled time of one forward of `model` (its own `quant`) on `tp` GPUs of `hw`."""
    if context < 0:
        raise ValueError(f"context={context} is not allowed: an integer >= 0")
    return evaluate(forward_ops(model, hw, tp=tp, tokens=tokens, layers=layers, cal=cal), hw, context)


def early_exit_model(target: ModelConfig, exit_layer: int) -> ModelConfig:
    """An early-exit draft: the target's first `exit_layer` layers plus its LM head."""
    return dataclasses.replace(target, layers=exit_layer, kind="transformer")


def op_seconds(model: ModelConfig, hw: HardwareConfig, *, tp: int, tokens: int, context: int,
               cal: Calibration = DEFAULT_CALIBRATION) -> dict[str, float]:
    """Time of one instance of each op of a whole-model forward (for calibration and tests)."""
    launch_s = hw.gpu.launch_us * 1e-6
    return {op.name: op.seconds(context, launch_s)
            for op in forward_ops(model, hw, tp=tp, tokens=tokens, layers=None, cal=cal)}

