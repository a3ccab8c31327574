"""The native GEMMs of a forward over T rows against the host's roofline, and against another
build of specbed_kernels/native.cpp (paired, alternated call by call: the host drifts by 20-30 %).

    .venv/bin/python benchmarks/bench_gemm_rows.py [--base OLD_NATIVE_CPP] [--rows 1 2 4 8 16 32 64]
        [--dtypes bf16 fp32] [--repeats 7] [--what layers head]

``layers``: the 30 layers' GEMMs of SmolLM2-135M (QKV, output, SwiGLU [gate; up], down; each
matrix its own copy, so they stream from memory as in a forward); ``head``: the LM head
[49152, 576]. % roofline = max(bytes / read bandwidth, FLOPs / FMA peak) / time, both probed
before each repeat; ``x base``: the median over repeats of base time / this build's time, the
two builds taking turns layer by layer (call by call for the head).
Run pinned (taskset -c CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from specbed_kernels import native

DIM, FFN, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
CODES = {"fp32": (0, torch.float32), "bf16": (1, torch.bfloat16)}


def load(source: Path) -> ctypes.CDLL:
    path = native.build(source)
    if path is None:
        raise SystemExit(f"{source}: build failed")
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.sb_packed_elems.argtypes, lib.sb_packed_elems.restype = [i32, i32, i64, i64], i64
    lib.sb_pack.argtypes, lib.sb_pack.restype = [i32, i32, ptr, i64, i64, ptr], i32
    lib.sb_linear.argtypes, lib.sb_linear.restype = [i32, ptr, ptr, ptr, ptr, i64, i64, i64, i32], i32
    lib.sb_swiglu.argtypes, lib.sb_swiglu.restype = [i32, ptr, ptr, ptr, i64, i64, i64, i32], i32
    lib.sb_fma_peak.argtypes, lib.sb_fma_peak.restype = [ctypes.c_double], ctypes.c_double
    lib.sb_read_sum.argtypes, lib.sb_read_sum.restype = [ptr, i64, i32], ctypes.c_double
    return lib


def pack(lib: ctypes.CDLL, code: int, w: torch.Tensor, paired: bool) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(int(lib.sb_packed_elems(code, int(paired), n, k)) + 64, dtype=w.dtype)
    off = (-out.data_ptr() // w.element_size()) % (64 // w.element_size())  # 64-byte aligned
    out = out[off:off + int(lib.sb_packed_elems(code, int(paired), n, k))]
    assert lib.sb_pack(code, int(paired), w.data_ptr(), n, k, out.data_ptr()) == 0
    return out


class Gemms:
    """One build's packed copies of the GEMMs and a runner over T rows."""

    def __init__(self, lib: ctypes.CDLL, code: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.lib, self.code = lib, code
        self.items = [(kind, w.shape, pack(lib, code, w, kind == "swiglu")) for kind, w in weights]

    def run(self, xs: dict[int, torch.Tensor], out: torch.Tensor, lo: int = 0, hi: int | None = None) -> float:
        """GEMMs [lo, hi) on the rows of xs[K] (the same rows, as wide as each matrix's K); seconds."""
        start = time.perf_counter()
        for kind, (n, k), p in self.items[lo:hi]:
            x = xs[k]
            if kind == "swiglu":
                self.lib.sb_swiglu(self.code, x.data_ptr(), p.data_ptr(), out.data_ptr(), x.shape[0], n // 2, k, 1)
            else:
                self.lib.sb_linear(self.code, x.data_ptr(), p.data_ptr(), None, out.data_ptr(), x.shape[0], n, k,
                                   1)
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="", help="another native.cpp to compare with (paired)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(CODES))
    ap.add_argument("--what", nargs="+", default=["layers", "head"], choices=["layers", "head"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    new = load(native.SOURCE)
    base = load(Path(args.base)) if args.base else None
    probe = torch.ones(32 << 20)
    gen = torch.Generator().manual_seed(0)
    print("| dtype | what | rows | ms | % FMA peak | % roofline | x base |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        code, dtype = CODES[name]
        for what in args.what:
            if what == "layers":
                shapes = [("linear", (QKV, DIM)), ("linear", (DIM, DIM)), ("swiglu", (2 * FFN, DIM)),
                          ("linear", (DIM, FFN))] * LAYERS
            else:
                shapes = [("linear", (VOCAB, DIM))]
            weights = [(kind, (torch.randn(*s, generator=gen) * 0.05).to(dtype)) for kind, s in shapes]
            nbytes = sum(w.numel() * w.element_size() for _, w in weights)
            macs = sum(w.numel() for _, w in weights)
            builds = [Gemms(new, code, weights)] + ([Gemms(base, code, weights)] if base else [])
            del weights
            for t in args.rows:
                x = (torch.randn(t, max(DIM, FFN), generator=gen)).to(dtype)
                xs = {DIM: x[:, :DIM].contiguous(), FFN: x.contiguous()}
                out = torch.empty(t, VOCAB, dtype=dtype)
                times: list[list[float]] = [[] for _ in builds]
                roofs = []
                peaks = []

                for g in builds:
                    g.run(xs, out)  # warm
                for r in range(args.repeats):
                    start = time.perf_counter()
                    new.sb_read_sum(probe.data_ptr(), probe.numel(), 1)
                    bw = probe.numel() * 4 / (time.perf_counter() - start)
                    peak = new.sb_fma_peak(0.02) * 1e9
                    peaks.append(peak)
                    roofs.append(max(nbytes / bw, 2 * macs * t / peak))
                    # the builds take turns per layer (per call for the head), the order swapped
                    # every turn: both see the same drift of the host
                    step = 4 if what == "layers" else 1
                    spent = [0.0] * len(builds)
                    for turn, lo in enumerate(range(0, len(builds[0].items), step)):
                        for j in (range(len(builds)) if (turn + r) % 2 == 0 else reversed(range(len(builds)))):
                            spent[j] += builds[j].run(xs, out, lo, lo + step)
                    for j in range(len(builds)):
                        times[j].append(spent[j])
                ms = statistics.median(times[0])
                pct_peak = 100 * statistics.median(2 * macs * t / (tt * p) for tt, p in zip(times[0], peaks))
                pct_roof = 100 * statistics.median(ro / tt for ro, tt in zip(roofs, times[0]))
                ratio = (f"{statistics.median(b / a for a, b in zip(times[0], times[1])):.2f}"
                         if base else "")
                print(f"| {name} | {what} | {t} | {ms * 1e3:.1f} | {pct_peak:.0f} | {pct_roof:.0f} | {ratio} |",
                      flush=True)


if __name__ == "__main__":
    main()
