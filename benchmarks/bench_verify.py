"""A k-token forward (a verification window, a tree of k nodes, a draft expansion) against the
host's roofline, for k = 1..16, fp32 and bf16, with torch eager and torch.compile as baselines.

    .venv/bin/python benchmarks/bench_verify.py [--dtypes fp32 bf16] [--ks 1 2 ... 16]
        [--context 200] [--repeats 9] [--baseline-ks 1 4 8 16] [--no-compile] [--tp2]
        [--cpus 1] [--json FILE]

Speculative decoding pays because verifying k tokens costs about one token's forward: decode
reads every weight once per forward, so a forward's time is max(bytes / read bandwidth, FLOPs /
GEMM peak) -- the roofline -- and stays flat in k until the FLOPs catch up. This benchmark
measures that roofline *in the same run* on the same core(s) and reports each forward's share
of it:
- read bandwidth: the best of torch's ``sum()`` over 512 MB and the native streaming read
  (``specbed_kernels/native.cpp: sb_read_sum``), one core (TP 1) and both cores at once (TP 2);
- GEMM peak per dtype: the best of a large ``torch.matmul`` in that dtype, in fp32, and the
  native FMA-throughput probe (``sb_fma_peak``) -- on a CPU without bf16 arithmetic the fp32
  FMA rate is the honest ceiling of bf16 math;
- bytes: every GEMM weight once (the LM head included) plus the KV cache read; FLOPs: 2 per
  GEMM weight per token plus attention's 4 x context x heads x head_dim per token and layer.

Per k and dtype: the native path's forward (ms, median of ``--repeats``), x k=1, the roofline
(ms and x k=1), % of the roofline; torch eager (the same model with the PyTorch/oneDNN ops) and
``torch.compile`` (inductor, freezing, a functional copy of the model with a static cache) at
``--baseline-ks``. ``--tp2``: the tensor-parallel forward on two pinned cores (bench_tp's
workers) at k = 1 and 8 against the two-core roofline. Run pinned (``--cpus``) on a quiet
machine; the load average at the start and end is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from roofline_probes import DTYPES, PROBE_BUFFERS, gemm_peak, model_cost

import specbed_kernels as kernels
from real.model.decoder import Transformer
from real.model.weights import load_model
from specbed_kernels import cpu, native, reference


# ------------------------------------------------------------------------------ the forwards
def time_forward(model: Transformer, k: int, context: int, repeats: int) -> float:
    tokens = torch.randint(0, 1000, (1, k), generator=torch.Generator().manual_seed(k))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            model.truncate(context)
            start = time.perf_counter()
            model(tokens, context)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def eager_ops() -> None:
    """The PyTorch/oneDNN ops of specbed_kernels/cpu.py, no native kernel (torch eager)."""
    kernels.reset()
    kernels.register("linear", cpu.linear if cpu.AVAILABLE else reference.linear)
    kernels.register("swiglu_fused", cpu.swiglu_fused if cpu.AVAILABLE else reference.swiglu_fused)
    kernels.register("decode_layers", reference.decode_layers)


def functional_forward(model: Transformer, context: int):
    """A plain-PyTorch copy of the model's forward over a static cache of ``context`` slots (the
    same GEMMs, attention and LM head; the cache is read, not written): torch.compile's input."""
    a = model.args
    layers = [(b.attention_norm, b.attention.wqkv, b.attention.wo, b.ffn_norm, b.feed_forward.w13,
               b.feed_forward.w2) for b in model.layers]
    caches = [(b.attention.kv_cache.k_cache[:, :, :context], b.attention.kv_cache.v_cache[:, :, :context])
              for b in model.layers]
    hq, hkv, d = a.n_heads, a.n_kv_heads, a.head_dim

    def forward(tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, model.tok_embeddings.weight)
        t = tokens.shape[1]
        for (n1, wqkv, wo, n2, w13, w2), (kc, vc) in zip(layers, caches):
            x = reference.rms_norm(h, n1, a.norm_eps)
            qkv = F.linear(x, wqkv).view(1, t, hq + 2 * hkv, d)
            qk = reference.apply_rope(qkv[:, :, : hq + hkv], cos, sin)
            q = qk[:, :, :hq].transpose(1, 2)
            k = torch.cat([kc, qk[:, :, hq:].transpose(1, 2)], dim=2)
            v = torch.cat([vc, qkv[:, :, hq + hkv:].transpose(1, 2)], dim=2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            h = h + F.linear(y.transpose(1, 2).reshape(1, t, hq * d), wo)
            gate, up = F.linear(reference.rms_norm(h, n2, a.norm_eps), w13).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w2)
        return F.linear(reference.rms_norm(h, model.norm, a.norm_eps), model.output).float()

    return forward


def time_compiled(model: Transformer, k: int, context: int, repeats: int) -> float:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    fn = torch.compile(functional_forward(model, context), dynamic=False)
    pos = torch.arange(context, context + k)
    cos, sin = model.rope_cos[pos], model.rope_sin_signed[pos]
    mask = torch.arange(context + k)[None, :] <= pos[:, None]
    tokens = torch.randint(0, 1000, (1, k))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):  # the first call compiles
            start = time.perf_counter()
            fn(tokens, cos, sin, mask)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


# ------------------------------------------------------------------------------ main
def load_avg() -> str:
    return "load avg " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def host_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in flags.split() if f in wanted)


def paired_roofline(model: Transformer, k: int, *, context: int, repeats: int, torch_peak: float) -> dict:
    """The forward timed ``repeats`` times, each right after a short read-bandwidth and FMA-peak
    probe: on a shared host both drift by 20-30 % within seconds, so each forward is compared
    with the roofline of its own moment, and the medians of the times and of the shares are kept."""
    tokens = torch.randint(0, 1000, (1, k), generator=torch.Generator().manual_seed(k))
    x = PROBE_BUFFERS.setdefault("small", torch.ones(32 << 20))  # 128 MB: past any cache
    nbytes, flops = model_cost(model, k, context)
    times, roofs, bws, peaks = [], [], [], []
    with torch.inference_mode():
        model.truncate(context)
        model(tokens, context)  # warm
        for _ in range(repeats):
            start = time.perf_counter()
            if native._LIB is not None:
                native._LIB.sb_read_sum(x.data_ptr(), x.numel(), 1)
            else:
                x.sum()
            bw = x.numel() * 4 / (time.perf_counter() - start)
            peak = max(torch_peak, native._LIB.sb_fma_peak(0.02) * 1e9 if native._LIB is not None else 0.0)
            model.truncate(context)
            start = time.perf_counter()
            model(tokens, context)
            times.append(time.perf_counter() - start)
            roofs.append(max(nbytes / bw, flops / peak))
            bws.append(bw)
            peaks.append(peak)
    shares = [r / t for r, t in zip(roofs, times)]
    return {"ms": statistics.median(times) * 1e3, "roofline_ms": statistics.median(roofs) * 1e3,
            "pct_roofline": 100 * statistics.median(shares), "bandwidth_gbs": statistics.median(bws) / 1e9,
            "peak_gflops": statistics.median(peaks) / 1e9, "bytes": nbytes, "flops": flops}


def run_dtype(name: str, args: argparse.Namespace) -> list[dict]:
    dtype = DTYPES[name]
    peaks = gemm_peak(dtype)
    torch_peak = max(v for k, v in peaks.items() if k.startswith("torch"))
    print(f"\n{name}: GEMM peak {max(peaks.values()) / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in peaks.items())}); each forward is paired "
          "with a read-bandwidth and FMA-peak probe just before it")
    with torch.inference_mode():  # as real runs load (real/runtime/engine.py): inference tensors
        model, _ = load_model(None, dtype=dtype, max_seq=args.context + 32)
        model(torch.randint(0, 1000, (1, args.context)), 0)
    rows = []
    for k in args.ks:
        kernels.reset()
        row = {"dtype": name, "k": k, **paired_roofline(model, k, context=args.context, repeats=args.repeats, torch_peak=torch_peak)}
        if k in args.baseline_ks:
            eager_ops()
            row["eager_ms"] = time_forward(model, k, args.context, args.repeats) * 1e3
            kernels.reset()
            if not args.no_compile:
                row["compile_ms"] = time_compiled(model, k, args.context, args.repeats) * 1e3
        rows.append(row)
    base, roof1 = rows[0]["ms"], rows[0]["roofline_ms"]
    print("| k | ms | × k=1 | read GB/s | FMA GFLOP/s | roofline ms | roofline × k=1 | % roofline | "
          "eager ms | compile ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = " | ".join(f"{r[c]:.1f}" if c in r else "" for c in ("eager_ms", "compile_ms"))
        print(f"| {r['k']} | {r['ms']:.1f} | {r['ms'] / base:.2f} | {r['bandwidth_gbs']:.1f} | "
              f"{r['peak_gflops']:.0f} | {r['roofline_ms']:.1f} | {r['roofline_ms'] / roof1:.2f} | "
              f"{r['pct_roofline']:.0f} | {extra} |", flush=True)
    kernels.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--ks", nargs="+", type=int, default=list(range(1, 17)))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--baseline-ks", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--tp2", action="store_true", help="also the TP 2 forward (bench_tp's workers)")
    ap.add_argument("--cpus", type=int, nargs="+", default=None, help="pin to these CPUs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    torch.set_num_threads(1)
    print(f"host flags: {host_flags()}; native kernels: {'on' if native.AVAILABLE else 'off'}; "
          f"CPUs {sorted(os.sched_getaffinity(0))}; {load_avg()}")
    result = {"host_flags": host_flags(), "context": args.context, "rows": []}
    for name in args.dtypes:
        result["rows"] += run_dtype(name, args)
    if args.tp2:
        from bench_verify_tp import run_tp2  # noqa: PLC0415 (beside this file; spawns processes)

        result["tp2"] = run_tp2(args)
    print(f"\n{load_avg()}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
