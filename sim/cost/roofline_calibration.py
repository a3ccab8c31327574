"""Calibration of the roofline constants against SwiftSpec's H800 kernel timings (seed 002).

Data (int4-AWQ Llama-3 family, batch 8 = 8 tokens per forward, one 8x H800 SXM node):
- Table 3: per-kernel times of one Llama-3-70B layer at TP=4 (context not stated; 512 assumed).
- Table 7, standard-kernel columns: fused GEMM (attn) = O proj + all-reduce, fused GEMM (mlp) =
  down proj + all-reduce, SwiGLU = gate/up GEMM + activation (vLLM and TRT-LLM; the reference is
  their geometric mean, they differ by up to 1.7x), attention at context 500 and 1000
  (FlashAttention; FlashInfer is left out: the paper notes it is not tuned for few heads).
- Whole forwards, for the per-forward host overhead only: §5.3 Llama-3.2-3B TP=4, 8 tokens,
  context 500 takes 3.54 ms with FlashAttention and SwiftSpec's fused GEMM/SwiGLU kernels (the
  standard-kernel equivalent adds Table 7's per-layer differences x 28 layers); §1: int4
  Llama-3-70B on 8 H800 with popular frameworks, ~30 s for ~3000 tokens (10 ms/token, 1 token,
  mean context ~1500).

Fit: least squares on log(predicted / measured), Table 3 and Table 7 weighted equally in total,
over five constants: achieved HBM fraction, kernel minimum latency (hardware.gpu.launch_us),
2-GPU all-reduce α (hardware.allreduce_alpha_us), all-reduce latency per extra GPU, attention
sync time. Then the per-forward TP sync (per GPU beyond the first) as the smallest value that
gives §1's shape (Llama-3B at least TP_SHAPE_MARGIN slower on 4 GPUs than on 2), the host overhead
refitted on the two whole forwards for each candidate. Result (`python -m
sim.cost.roofline_calibration` prints the full table, and the Table 1 shape):

    constant                      value     where
    HBM efficiency                0.6545    sim.cost.roofline_forward.HBM_EFFICIENCY
    kernel minimum latency        4.76 us   conf/hardware/h800x8.yaml gpu.launch_us
    all-reduce α (2 GPUs)         9.22 us   conf/hardware/h800x8.yaml allreduce_alpha_us
    all-reduce per extra GPU      0.54 us   sim.cost.roofline_forward.ALLREDUCE_PER_PEER_US
    attention sync                3.03 us   sim.cost.roofline_forward.ATTENTION_SYNC_US
    per-forward host overhead     970 us    sim.cost.roofline_forward.FORWARD_OVERHEAD_US
    TP sync per GPU beyond 1      137.9 us  sim.cost.roofline_forward.TP_SYNC_US

    RMS error: Table 3 14% (worst: 2nd all-reduce -26%, O projection -18%), per-layer total -8%;
    Table 7 20% vs the vLLM/TRT geometric mean (worst: Llama-3B GEMM(attn) +45%, i.e. +30% vs
    vLLM's 12.3 us), attention within -7%..+27% of FlashAttention; whole forwards -2% and +6%
    (-1% and +2% without the TP sync: the 70B TP 8 forward pays 7 x 138 us of it). The kernel
    errors do not change with the TP sync (it is per forward, not per kernel).
    The tables disagree with each other: for the same 70B TP=4 layer, Table 3's O projection +
    all-reduce is 22.8 us, Table 7's 15.5-16.9 us; no single kernel model matches both closer.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache

from sim.cost.roofline_forward import Calibration, forward_cost, op_seconds
from sim.presets import load_hardware_preset, load_model_preset
from testbed.config import HardwareConfig, ModelConfig

TOKENS = 8
TABLE3_CONTEXT = 512
# Table 3: Llama-3-70B, TP=4: operator -> (our op names, measured us)
TABLE3 = [("QKV projection", ("qkv",), 16.9), ("mask attention", ("attention",), 18.8),
          ("O projection", ("o_proj",), 10.8), ("all reduce", ("allreduce_attn",), 12.0),
          ("SwiGLU", ("gate_up",), 39.3), ("down projection", ("down",), 18.1),
          ("all reduce", ("allreduce_mlp",), 15.3)]
# Table 7 standard kernels, us: (model, tp) -> GEMM(attn) vLLM, TRT; GEMM(mlp) vLLM, TRT;
# SwiGLU vLLM, TRT; attention FA at context 500, 1000. OURS: SwiftSpec's fused kernels.
TABLE7 = {("llama3_2_1b", 4): (12.9, 10.2, 18.8, 11.0, 12.3, 11.5, 13.8, 13.8),
          ("llama3_2_3b", 4): (12.3, 10.0, 17.0, 10.3, 12.5, 11.8, 17.2, 18.3),
          ("llama3_8b", 4): (14.6, 10.3, 16.5, 11.9, 16.3, 15.0, 17.75, 18.13),
          ("llama3_70b", 4): (16.9, 15.5, 25.4, 26.1, 36.7, 31.9, 19.0, 19.1),
          ("llama3_70b", 8): (25.7, 17.2, 29.5, 20.7, 22.5, 22.0, 17.8, 18.2)}
TABLE7_OURS_3B_TP4 = (6.4, 8.7, 7.2)  # fused GEMM (attn), fused GEMM (mlp), SwiGLU
FORWARD_3B_TP4_MS = 3.54  # §5.3, with FlashAttention, the rest SwiftSpec's kernels
FORWARD_70B_TP8_MS = 10.0  # §1, ~30 s / ~3000 tokens
# §1 / Table 1 (times withheld): at batch 8 a Llama-3B takes longer on 4 GPUs than on 2. We ask for
# at least this much longer (context TABLE3_CONTEXT); the smallest TP sync doing so is the fit.
TP_SHAPE_MODEL, TP_SHAPE_MARGIN = "llama3_2_3b", 0.02


@cache
def int4(name: str) -> ModelConfig:
    return dataclasses.replace(load_model_preset(name), quant="int4_awq")


@cache
def h800() -> HardwareConfig:
    return load_hardware_preset("h800x8")


def _gm(a: float, b: float) -> float:
    return math.sqrt(a * b)


def kernel_points() -> list[tuple[str, str, int, int, tuple[str, ...], float]]:
    """(table, model, tp, context, op names summed, measured us) for every kernel figure."""
    pts = [("T3 " + label, "llama3_70b", 4, TABLE3_CONTEXT, ops, us) for label, ops, us in TABLE3]
    for (m, tp), v in TABLE7.items():
        pts += [(f"T7 GEMM(attn) {m} tp{tp}", m, tp, 500, ("o_proj", "allreduce_attn"), _gm(*v[0:2])),
                (f"T7 GEMM(mlp) {m} tp{tp}", m, tp, 500, ("down", "allreduce_mlp"), _gm(*v[2:4])),
                (f"T7 SwiGLU {m} tp{tp}", m, tp, 500, ("gate_up",), _gm(*v[4:6])),
                (f"T7 attn@500 {m} tp{tp}", m, tp, 500, ("attention",), v[6]),
                (f"T7 attn@1000 {m} tp{tp}", m, tp, 1000, ("attention",), v[7])]
    return pts


def predict_us(model: str, tp: int, *, context: int, ops: tuple[str, ...], hw: HardwareConfig,
               cal: Calibration) -> float:
    t = op_seconds(int4(model), hw, tp=tp, tokens=TOKENS, context=context, cal=cal)
    return 1e6 * sum(t[o] for o in ops)


def forward_points() -> list[tuple[str, str, int, int, int, float]]:
    """(label, model, tp, tokens, context, measured ms) of whole standard-kernel forwards."""
    std = TABLE7[("llama3_2_3b", 4)]
    extra_us = sum(_gm(*std[2 * i:2 * i + 2]) - TABLE7_OURS_3B_TP4[i] for i in range(3))
    ms_3b = FORWARD_3B_TP4_MS + 28 * extra_us / 1e3
    return [("§5.3 llama3_2_3b tp4 k=8", "llama3_2_3b", 4, 8, 500, ms_3b),
            ("§1 llama3_70b tp8 k=1", "llama3_70b", 8, 1, 1500, FORWARD_70B_TP8_MS)]


def _with(hw: HardwareConfig, launch_us: float, alpha_us: float) -> HardwareConfig:
    return dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, launch_us=launch_us),
                               allreduce_alpha_us=alpha_us)


def fit() -> tuple[Calibration, HardwareConfig]:
    """Least-squares fit; returns the calibration and the H800 preset with fitted latencies."""
    from scipy.optimize import least_squares

    base, pts = h800(), kernel_points()
    n3 = sum(p[0].startswith("T3") for p in pts)
    w = [math.sqrt(1 / n3 if p[0].startswith("T3") else 1 / (len(pts) - n3)) for p in pts]

    def unpack(x: list[float]) -> tuple[Calibration, HardwareConfig]:
        cal = Calibration(hbm_efficiency=float(x[0]), attention_sync_us=float(x[3]),
                          allreduce_per_peer_us=float(x[4]),
                          forward_overhead_us=0.0)
        return cal, _with(base, float(x[1]), float(x[2]))

    def resid(x: list[float]) -> list[float]:
        cal, hw = unpack(x)
        return [wi * math.log(predict_us(m, tp, context=c, ops=ops, hw=hw, cal=cal) / us)
                for wi, (_, m, tp, c, ops, us) in zip(w, pts)]

    x = least_squares(resid, [0.6, 4.0, 8.0, 1.0, 5.0], bounds=([0.05, 0, 0, 0, 0], [1, 50, 50, 10, 50])).x
    cal, hw = unpack(list(x))
    # TP sync: bisection for the smallest value giving §1's shape, the host overhead refit each time
    lo, hi = 0.0, 2000.0
    if tp_shape_ratio(with_overhead(cal, hw), hw) >= 1 + TP_SHAPE_MARGIN:
        hi = 0.0
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        ok = tp_shape_ratio(with_overhead(dataclasses.replace(cal, tp_sync_us=mid), hw), hw)
        lo, hi = (lo, mid) if ok >= 1 + TP_SHAPE_MARGIN else (mid, hi)
    return with_overhead(dataclasses.replace(cal, tp_sync_us=hi), hw), hw


def with_overhead(cal: Calibration, hw: HardwareConfig) -> Calibration:
    """`cal` with the host overhead fitted (log least squares) to the whole forwards."""
    from scipy.optimize import least_squares

    cal = dataclasses.replace(cal, forward_overhead_us=0.0)
    fwd = [(forward_cost(int4(m), hw, tp=tp, tokens=k, context=c, cal=cal).total_s * 1e3, ms)
           for _, m, tp, k, c, ms in forward_points()]
    res = least_squares(lambda o: [math.log((p + o[0] / 1e3) / ms) for p, ms in fwd], [1000.0],
                        bounds=([0.0], [1e5]))
    return dataclasses.replace(cal, forward_overhead_us=float(res.x[0]))


def tp_shape_ratio(cal: Calibration, hw: HardwareConfig, model: str = TP_SHAPE_MODEL) -> float:
    """Forward time at TP 4 over TP 2 (8 tokens, context TABLE3_CONTEXT)."""
    t2, t4 = (forward_cost(int4(model), hw, tp=tp, tokens=TOKENS, context=TABLE3_CONTEXT, cal=cal).total_s
              for tp in (2, 4))
    return t4 / t2


def tp_scaling_table(cal: Calibration, hw: HardwareConfig, context: int = TABLE3_CONTEXT
                     ) -> dict[str, list[float]]:
    """ms of one 8-token forward of the int4 Llama-3 family at TP 1, 2, 4, 8 (seed 002 Table 1)."""
    return {m: [forward_cost(int4(m), hw, tp=tp, tokens=TOKENS, context=context, cal=cal).total_s * 1e3
                for tp in (1, 2, 4, 8)]
            for m in ("llama3_2_1b", "llama3_2_3b", "llama3_8b", "llama3_70b")}


def report(cal: Calibration, hw: HardwareConfig) -> str:
    lines = [f"HBM efficiency {cal.hbm_efficiency:.4f}  launch_us {hw.gpu.launch_us:.2f}  "
             f"allreduce_alpha_us {hw.allreduce_alpha_us:.2f}  per-peer {cal.allreduce_per_peer_us:.3f}"
             f"  attention sync {cal.attention_sync_us:.2f}  host overhead {cal.forward_overhead_us:.0f} us"
             f"  TP sync {cal.tp_sync_us:.1f} us/GPU",
             f"{'point':<34}{'measured':>10}{'model':>10}{'error':>8}"]
    errs: dict[str, list[float]] = {"T3": [], "T7": []}
    for label, m, tp, c, ops, us in kernel_points():
        p = predict_us(m, tp, context=c, ops=ops, hw=hw, cal=cal)
        errs[label[:2]].append((p - us) / us)
        lines.append(f"{label:<34}{us:>10.2f}{p:>10.2f}{100 * (p - us) / us:>+7.0f}%")
    layer = sum(predict_us("llama3_70b", 4, context=TABLE3_CONTEXT, ops=o, hw=hw, cal=cal) for _, o, _ in TABLE3)
    lines.append("RMS error " + ", ".join(f"{k} {100 * math.sqrt(sum(e * e for e in v) / len(v)):.0f}%"
                                        for k, v in errs.items())
                 + f"; Table 3 layer total {100 * (layer / sum(u for *_, u in TABLE3) - 1):+.0f}%")
    for label, m, tp, k, c, ms in forward_points():
        p = forward_cost(int4(m), hw, tp=tp, tokens=k, context=c, cal=cal).total_s * 1e3
        lines.append(f"{label + ' (ms)':<34}{ms:>10.2f}{p:>10.2f}{100 * (p - ms) / ms:>+7.0f}%")
    lines.append(f"{'Table 1 shape (ms, 8 tokens)':<34}{'TP 1':>8}{'TP 2':>8}{'TP 4':>8}{'TP 8':>8}")
    for m, row in tp_scaling_table(cal, hw).items():
        lines.append(f"{m:<34}" + "".join(f"{v:>8.2f}" for v in row))
    return "\n".join(lines)


if __name__ == "__main__":
    print("stored constants:\n" + report(Calibration(), h800()))
    print("\nrefit:\n" + report(*fit()))
