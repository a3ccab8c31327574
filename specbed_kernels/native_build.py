"""Building and loading the native kernels' library (specbed_kernels/native.cpp) for ctypes.

Build: ``$CXX`` (else g++/c++) ``-O3 -march=native -fopenmp``, cached under
``$XDG_CACHE_HOME/specbed`` (default ``~/.cache/specbed``) by a hash of the source, flags,
compiler and CPU, so it is compiled once per machine (~3 s). No compiler, a failed build or
``SPECBED_NATIVE=0``: ``specbed_kernels.native.AVAILABLE`` is False and the registry keeps the
oneDNN/PyTorch ops.
The library links libgomp by soname, which PyTorch has already loaded, so both share one
OpenMP runtime and the caller passes ``torch.get_num_threads()``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("native.cpp")
# SPECBED_NATIVE_FLAGS adds compiler flags, e.g. "-mno-avx512f" to build and measure the AVX2 path
# on an AVX-512 host (benchmarks/bench_verify.py prints which ISA the library was built for)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         *os.environ.get("SPECBED_NATIVE_FLAGS", "").split()]


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(line for line in info.splitlines()[:40]
                         if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specbed"


def build(source: Path = SOURCE) -> Path | None:
    """Compile ``source`` (default native.cpp) into a shared library (or reuse the cached one);
    None if no compiler or it fails."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None or not source.is_file():
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join([source.read_text(), *FLAGS, version, _cpu_id()]).encode()).hexdigest()
    lib = _cache_dir() / f"{source.stem}-{key[:16]}.so"
    if lib.is_file():
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            proc = subprocess.run([cxx, *FLAGS, str(source), "-o", str(out)],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                warnings.warn(f"specbed_kernels.native: build failed, using oneDNN:\n{proc.stderr[-2000:]}",
                              stacklevel=2)
                return None
            os.replace(out, lib)  # atomic: concurrent builders never see half a library
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"specbed_kernels.native: build failed ({exc}), using oneDNN", stacklevel=2)
        return None
    return lib


class LayerPtrs(ctypes.Structure):  # native.cpp: LayerPtrs
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2", "k_cache", "v_cache")]


class LayerDims(ctypes.Structure):  # native.cpp: LayerDims
    _fields_ = [*((name, ctypes.c_long) for name in
                  ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq")),
                ("dtype", ctypes.c_int), ("cache_dtype", ctypes.c_int), ("eps", ctypes.c_float)]


def load(source: Path = SOURCE) -> ctypes.CDLL | None:
    """The library built from ``source`` with every function's ctypes signature; None where
    ``SPECBED_NATIVE=0`` or the build fails."""
    if os.environ.get("SPECBED_NATIVE", "1") == "0":
        return None
    path = build(source)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    signatures = {
        "sb_packed_elems": ([i32, i32, i64, i64], i64),
        "sb_pack": ([i32, i32, ptr, i64, i64, ptr], i32),
        "sb_linear": ([i32, ptr, ptr, ptr, ptr, i64, i64, i64, i32], i32),
        "sb_swiglu": ([i32, ptr, ptr, ptr, i64, i64, i64, i32], i32),
        "sb_layers": ([ctypes.POINTER(LayerDims), ctypes.POINTER(LayerPtrs), i32, ptr, ptr,
                       ptr, ptr, ptr, i64, i64, i32, ptr, ptr], i32),
        "sb_layers_batch": ([ctypes.POINTER(LayerDims), ctypes.POINTER(LayerPtrs), i32, ptr, ptr,
                             ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32, ptr, ptr], i32),
        "sb_token_features": ([ptr, i64, i64, i32, ptr], i32),
        "sb_max_tokens": ([], i64),
        "sb_fma_peak": ([ctypes.c_double], ctypes.c_double),
        "sb_has_avx512": ([], i32),
        "sb_read_sum": ([ptr, i64, i32], ctypes.c_double),
        "sb_topk": ([ptr, i64, i64, i64, ptr, ptr, ptr], i32),
        "sb_top_p": ([ptr, i64, i64, ctypes.c_double, ptr], i32),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


