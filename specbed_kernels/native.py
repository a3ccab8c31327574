"""Native CPU kernels (specbed_kernels/native.cpp), compiled on first use, called via ctypes.

Why: a decode step or a speculative verification multiplies 1-16 token rows by every weight
matrix, so its time is the weights' bytes over the memory bandwidth until the FLOPs catch up
with the core's FMA peak: the premise of speculative decoding (verifying k tokens costs about one
token) holds only if a k-token forward runs at that roofline. oneDNN and MKL stream weights at
~50-80% of the read bandwidth at one token and scale ~linearly in k beyond a few tokens (their
small-M GEMMs re-read the weights or leave the FMA units idle); torch's bf16 matmul has no fast
path at all on CPUs without AVX512-BF16. native.cpp packs each weight matrix once into panels
and runs a register-tiled outer-product GEMM in which every weight byte is read once per forward
for any number of tokens (benchmarks/bench_verify.py measures it against the host's roofline and
against torch eager and torch.compile). ``decode_layers`` runs a whole run of decoder layers in
one call, which removes ~20 PyTorch dispatches per layer.

Which code runs is fixed at build time by ``-march=native`` (see the top of native.cpp):
AVX-512F (with AVX512-BF16's vdpbf16ps for bf16 where present), AVX2+FMA, or a portable
vector-extension path.

Packed weights: ``packed(weight)`` keeps one packed copy per weight tensor (weakly keyed, checked
against the tensor's storage pointer and version counter, so in-place updates repack), i.e. the
weights the native path uses take their size once more in memory. They are carved out of arenas
backed by 2 MB transparent huge pages where the kernel offers them (``_panel_arena``): a forward
streams every panel once, and with 4 KB pages that stream crosses a page, i.e. a TLB miss and a
stop of the hardware prefetchers, every 4 KB (benchmarks/bench_hugepages.py measures both).

Build and loading: specbed_kernels/native_build.py.

Only CPU, contiguous fp32 or bf16 tensors (weights and activations of one dtype) use the
kernels; the fused layers take up to ``MAX_TOKENS`` tokens (longer prefills run op by op, their
GEMMs still native).
"""

from __future__ import annotations

import ctypes
import platform
import threading
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from specbed_kernels import cpu
from specbed_kernels.native_build import SOURCE, build, load  # noqa: F401 (SOURCE, build: allreduce.py, benchmarks)
from specbed_kernels.native_build import LayerDims as _LayerDims
from specbed_kernels.native_build import LayerPtrs as _LayerPtrs

_CODES = {torch.float32: 0, torch.bfloat16: 1}

_LIB = load()
MAX_TOKENS = int(_LIB.sb_max_tokens()) if _LIB is not None else 0  # rows per fused-layers call


def _usable(x: Tensor, weight: Tensor) -> bool:
    # no autograd through ctypes: anything that needs gradients takes the PyTorch ops
    return (x.device.type == "cpu" and x.dtype in _CODES and weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and weight.dim() == 2 and weight.device.type == "cpu" and x.shape[-1] == weight.shape[1]
            and x.numel() > 0)


# Packed copies: id(weight) -> (weakref to weight, (storage pointer, version), paired, packed).
# The version counter catches in-place updates (``copy_``, an optimizer step); tensors made in
# inference mode have none, and are only checked by pointer.
_PACKED: dict[int, tuple[weakref.ref, tuple[int, int], bool, Tensor]] = {}


def _version(t: Tensor) -> int:
    # an inference tensor (the real backend loads its models in inference mode) has no version
    # counter; asking raises, and the raise costs ~16 us, paid by every weight on every forward
    return -1 if t.is_inference() else t._version


HUGE_PAGE = 2 << 20
ARENA_BYTES = 256 << 20  # panels of one model share few arenas; a bigger weight gets its own
_MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGES = platform.system() == "Linux"  # benchmarks/bench_hugepages.py switches it off to compare
_arena: list = []  # [the arena being filled (uint8), bytes used]; filled arenas live while their panels do
# two threads of one process (the schedules' threaded runs: a target and a draft thread) may pack
# at once; without the lock both could be handed the same bytes of the arena
_arena_lock = threading.Lock()


def _advise_huge(buf: Tensor) -> int:
    """madvise(MADV_HUGEPAGE) over the 2 MB-aligned interior of ``buf`` before it is touched (the
    pages are then faulted in as huge pages); returns the offset of that interior, -1 if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        start = (buf.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        length = (buf.data_ptr() + buf.numel() - start) // HUGE_PAGE * HUGE_PAGE
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if length <= 0 or libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
            return -1  # THP disabled ("never") or not this kernel: 4 KB pages, as torch.empty gives
        return start - buf.data_ptr()
    except (OSError, AttributeError):
        return -1


def _panel_arena(numel: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised 1-D tensor for packed panels, 64-byte aligned, from a huge-page arena."""
    if not HUGE_PAGES:
        return torch.empty(numel, dtype=dtype)
    nbytes = -(-numel * torch.empty((), dtype=dtype).element_size() // 64) * 64
    if nbytes > ARENA_BYTES // 4:  # a large weight (the LM head): an arena of its own
        buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        off = _advise_huge(buf)
        off = max(off, (-buf.data_ptr()) % 64)
        return buf[off:off + nbytes].view(dtype)[:numel]
    with _arena_lock:
        if not _arena or _arena[1] + nbytes > _arena[0].numel():
            buf = torch.empty(ARENA_BYTES + HUGE_PAGE, dtype=torch.uint8)
            off = _advise_huge(buf)
            off = max(off, (-buf.data_ptr()) % 64)
            _arena[:] = [buf[off:off + ARENA_BYTES], 0]
        start = _arena[1]
        _arena[1] += nbytes
        return _arena[0][start:start + nbytes].view(dtype)[:numel]


def packed(weight: Tensor, paired: bool = False) -> Tensor:
    """``weight [N, K]`` in native.cpp's panel layout (``paired``: SwiGLU's [gate; up] rows),
    packed once and kept while the weight lives and is unchanged."""
    key = id(weight)
    stamp = (weight.data_ptr(), _version(weight))
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == stamp and hit[2] == paired:
        return hit[3]
    n, k = weight.shape
    code = _CODES[weight.dtype]
    out = _panel_arena(int(_LIB.sb_packed_elems(code, int(paired), n, k)), weight.dtype)
    src = weight.detach().contiguous()
    if _LIB.sb_pack(code, int(paired), src.data_ptr(), n, k, out.data_ptr()):
        raise ValueError(f"cannot pack a [{n}, {k}] weight{' as SwiGLU pairs' if paired else ''}")
    _PACKED[key] = (weakref.ref(weight, lambda _ref, key=key: _PACKED.pop(key, None)), stamp, paired, out)
    return out


def token_features(logits: Tensor, token: int, k: int) -> list[float] | None:
    """The k largest probabilities of softmax(logits), its entropy and p[token] (k + 2 floats)
    in one native call; None where the kernel does not apply (then the caller's PyTorch ops)."""
    if _LIB is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    x = logits.reshape(-1).contiguous()
    out = (ctypes.c_float * (k + 2))()
    if _LIB.sb_token_features(x.data_ptr(), x.numel(), token, k, out):
        return None
    return list(out)


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """``torch.topk(x, k, dim=-1)`` (sorted; among equal values the lower index first) for CPU
    fp32 rows, and per row how many values are >= the k-th (k unless it ties with one left out);
    ~3x faster than torch.topk on a 49k vocabulary; None where it does not apply."""
    if _LIB is None or x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < k <= x.shape[-1]:
        return None
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    vals = torch.empty(rows.shape[0], k)
    idx = torch.empty(rows.shape[0], k, dtype=torch.long)
    n_ge = torch.empty(rows.shape[0], dtype=torch.long)
    if _LIB.sb_topk(rows.data_ptr(), rows.shape[0], rows.shape[1], k, vals.data_ptr(), idx.data_ptr(),
                    n_ge.data_ptr()):
        return None
    return vals.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k), n_ge.view(x.shape[:-1])


def top_p_(probs: Tensor, top_p: float) -> bool:
    """In place over CPU fp32 probability rows [..., V]: each row renormalised on its smallest
    most-probable prefix (ties lower index first) whose mass reaches ``top_p``, zero elsewhere
    (``testbed.spec.sampling.nucleus``'s definition, by a radix select instead of a sort).
    False (``probs`` untouched) where it does not apply."""
    if (_LIB is None or probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.shape[-1] == 0
            or not probs.is_contiguous()):
        return False
    rows = probs.numel() // probs.shape[-1]
    return _LIB.sb_top_p(probs.data_ptr(), rows, probs.shape[-1], float(top_p), probs.data_ptr()) == 0


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T; the native kernel where it applies, else ``specbed_kernels.cpu.linear``."""
    return linear_add(x, weight, None)


def linear_add(x: Tensor, weight: Tensor, residual: Tensor | None) -> Tensor:
    """x @ weight.T + residual (residual shaped like the output, or None)."""
    if _LIB is None or not _usable(x, weight) or (residual is not None and residual.dtype != x.dtype):
        y = cpu.linear(x, weight)
        return y if residual is None else y.add_(residual)
    x = x.contiguous()
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    res = None
    if residual is not None:
        res = residual.contiguous()
        if res.shape != y.shape:
            res = res.expand(y.shape).contiguous()
        res = res.data_ptr()
    _LIB.sb_linear(_CODES[x.dtype], x.data_ptr(), packed(weight).data_ptr(), res, y.data_ptr(),
                   x.numel() // k, n, k, torch.get_num_threads())
    return y


def swiglu_fused(x: Tensor, w_gate_up: Tensor) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) with ``w_gate_up = [gate; up]`` in one pass over the weights."""
    if _LIB is None or not _usable(x, w_gate_up) or w_gate_up.shape[0] % 2:
        return cpu.swiglu_fused(x, w_gate_up)
    x = x.contiguous()
    two_f, k = w_gate_up.shape
    y = torch.empty(*x.shape[:-1], two_f // 2, dtype=x.dtype)
    _LIB.sb_swiglu(_CODES[x.dtype], x.data_ptr(), packed(w_gate_up, paired=True).data_ptr(), y.data_ptr(),
                   x.numel() // k, two_f // 2, k, torch.get_num_threads())
    return y


# Packed layer pointers: model -> {(lo, hi): (cache_epoch, tensors, their stamps, packed
# pointers, dims)}, weak so that a dropped model frees its weights. Gathering the tensors walks
# ~240 module attributes (~250 us); checking them is one data_ptr() each plus the weights'
# version counters (~30 us), which catches weights or caches moved (``model.to(...)``,
# ``param.data = ...``) and weights updated in place (their packed copies are then stale);
# ``Transformer.setup_cache`` bumps ``cache_epoch`` when it installs new cache modules.
_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_data_ptr = Tensor.data_ptr


def _gather(model, lo: int, hi: int) -> list[Tensor] | None:  # model: real.model.decoder.Transformer
    tensors: list[Tensor] = []
    for layer in model.layers[lo:hi]:
        att, ffn, cache = layer.attention, layer.feed_forward, layer.attention.kv_cache
        if cache is None:
            return None
        tensors += (layer.attention_norm, att.wqkv, att.wo, layer.ffn_norm, ffn.w13, ffn.w2,
                    cache.k_cache, cache.v_cache)
    return tensors


def _stamps(tensors: list[Tensor]) -> tuple:
    # caches are written in place every step: their pointers only
    return (tuple(map(_data_ptr, tensors)),
            tuple(_version(t) for i, t in enumerate(tensors) if i % 8 < 6))


def _pack(model, lo: int, hi: int) -> tuple[object, _LayerDims] | None:
    packs = _PACKS.setdefault(model, {})
    epoch = getattr(model, "cache_epoch", -1)
    hit = packs.get((lo, hi))
    if hit is not None and hit[0] == epoch and _stamps(hit[1]) == hit[2]:
        return hit[3], hit[4]
    tensors = _gather(model, lo, hi)
    if tensors is None:
        return None
    a, n = model.args, hi - lo
    # a tensor-parallel rank (real/model/tp.py) holds its own heads and FFN slice, the same in every layer
    att, ffn_dim = model.layers[lo].attention, model.layers[lo].feed_forward.w2.shape[1]
    weights = [t for i, t in enumerate(tensors) if i % 8 < 6]
    caches = [t for i, t in enumerate(tensors) if i % 8 >= 6]
    dtype, cache_dtype = weights[0].dtype, caches[0].dtype
    if (dtype not in _CODES or cache_dtype not in _CODES or a.head_dim > 512
            or any(t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" for t in weights)
            or any(c.dtype != cache_dtype or not c.is_contiguous() or c.device.type != "cpu" for c in caches)):
        return None
    ptrs = []
    for i, t in enumerate(tensors):  # the GEMM weights in panels, the rest as they are
        role = i % 8
        ptrs.append(packed(t, paired=role == 4).data_ptr() if role in (1, 2, 4, 5) else t.data_ptr())
    layer_ptrs = (_LayerPtrs * n)(*(_LayerPtrs(*ptrs[8 * i:8 * i + 8]) for i in range(n)))
    dims = _LayerDims(a.dim, att.n_heads, att.n_kv_heads, a.head_dim, ffn_dim,
                      caches[0].shape[2], _CODES[dtype], _CODES[cache_dtype], a.norm_eps)
    packs[(lo, hi)] = (epoch, tensors, _stamps(tensors), layer_ptrs, dims)
    return layer_ptrs, dims


def _tp_hook(model, lo: int) -> tuple[Any, Any, Any] | None:  # model: real.model.decoder.Transformer
    """(the group's all-reduce, its native function, its context), all None off tensor
    parallelism; None where the fused layers must not run. Tensor parallel (real/model/tp.py):
    the layers' partial sums are all-reduced inside the call through the group's native
    callback; a group without one takes the op-by-op path, which sums after wo and w2. Never
    run sharded layers without the sums."""
    allreduce = getattr(model, "tp_allreduce", None)
    if allreduce is not None:
        hook = allreduce.native()
        return None if hook is None else (allreduce, *hook)
    if (model.layers[lo].attention.n_heads != model.args.n_heads
            or model.layers[lo].feed_forward.w2.shape[1] != model.args.ffn_dim):
        return None  # sharded without an all-reduce: not this kernel's to decide
    return None, None, None


def _fused_call(model, lo: int, hi: int, h: Tensor, cos: Tensor) -> tuple | None:
    """(all-reduce, its native fn and ctx, packed layers, dims) for one sb_layers call on the rows
    of ``h [1, T, dim]``, or None where the fused path does not apply (no library, not the CPU,
    autograd, more than ``MAX_TOKENS`` rows, another dtype, a TP group without a native sum)."""
    if _LIB is None or hi <= lo or h.device.type != "cpu" or h.dim() != 3 or h.shape[0] != 1:
        return None
    if torch.is_grad_enabled() and (h.requires_grad or model.norm.requires_grad):
        return None  # no autograd through ctypes
    if h.shape[1] > MAX_TOKENS or h.dtype not in _CODES or cos.dtype != h.dtype:
        return None
    hook = _tp_hook(model, lo)
    if hook is None:
        return None
    packed = _pack(model, lo, hi)
    if packed is None or _CODES[h.dtype] != packed[1].dtype:
        return None
    return (*hook, *packed)


def decode_layers(model, lo: int, hi: int, h: Tensor, *, cos: Tensor, sin: Tensor, pos: Tensor,
                  mask: Tensor | None, kv_len: int) -> Tensor | None:
    """Layers ``[lo, hi)`` of ``model`` (a real.model.decoder.Transformer) on ``h [1, T, dim]`` (T <= ``MAX_TOKENS``)
    in one native call, or None when this case is not covered (the model then runs op by op).
    Arguments as in ``Transformer.forward_layers`` after it resolved positions and the mask."""
    fused = _fused_call(model, lo, hi, h, cos)
    if fused is None:
        return None
    allreduce, ar_fn, ar_ctx, layers, dims = fused
    t = h.shape[1]
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape[-2:] != (t, kv_len) or mask.numel() != t * kv_len:
            return None
        mask = mask.reshape(t, kv_len).contiguous()
    out = h.clone(memory_format=torch.contiguous_format)  # updated in place; the caller keeps h
    slots = pos.to(torch.long).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    rc = _LIB.sb_layers(ctypes.byref(dims), layers, hi - lo, out.data_ptr(), slots.data_ptr(),
                        cos.data_ptr(), sin.data_ptr(), None if mask is None else mask.data_ptr(),
                        kv_len, t, torch.get_num_threads(), ar_fn, ar_ctx)
    if rc > 1:  # the all-reduce failed mid-way: the ranks are out of step, falling back would hang
        raise allreduce.error(rc)
    return out if rc == 0 else None


def batch_layers(model, h: Tensor, *, hi: int, cos: Tensor, sin: Tensor, slots: Tensor, starts: list[int],
                 kv_lens: list[int], cache_rows: list[int], masks: list[Tensor | None], lo: int = 0) -> Tensor | None:
    """Layers ``[lo, hi)`` of ``model`` on the rows of several sequences at once (continuous batching):
    ``h [1, R, dim]``, rows ``starts[i]:starts[i + 1]`` of sequence i, written at ``slots`` of
    KV-cache batch row ``cache_rows[i]``, attending over its slots ``[0, kv_lens[i])`` through
    ``masks[i]`` (bool ``[T_i, kv_lens[i]]``) or causally (None). None where the native path does
    not apply (the caller runs the rows op by op): R > ``MAX_TOKENS``, autograd, a tensor-parallel
    group without a native all-reduce."""
    fused = _fused_call(model, lo, hi, h, cos)
    if fused is None:
        return None
    allreduce, ar_fn, ar_ctx, layers, dims = fused
    n = len(kv_lens)
    offsets, parts, off = [], [], 0
    for i, m in enumerate(masks):
        if m is None:
            offsets.append(-1)
            continue
        rows = starts[i + 1] - starts[i]
        if m.dtype != torch.bool or tuple(m.shape[-2:]) != (rows, kv_lens[i]) or m.numel() != rows * kv_lens[i]:
            return None
        offsets.append(off)
        parts.append(m.reshape(-1))
        off += m.numel()
    mask = torch.cat(parts).contiguous() if parts else None
    ints = torch.tensor([*starts, *kv_lens, *cache_rows, *offsets], dtype=torch.long)
    out = h.clone(memory_format=torch.contiguous_format)
    slots = slots.to(torch.long).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    base, step = ints.data_ptr(), ints.element_size()
    rc = _LIB.sb_layers_batch(ctypes.byref(dims), layers, hi - lo, out.data_ptr(), slots.data_ptr(),
                              cos.data_ptr(), sin.data_ptr(), None if mask is None else mask.data_ptr(), n,
                              base, base + step * (n + 1), base + step * (2 * n + 1), base + step * (3 * n + 1),
                              torch.get_num_threads(), ar_fn, ar_ctx)
    if rc > 1:  # the all-reduce failed mid-way: the ranks are out of step, falling back would hang
        raise allreduce.error(rc)
    return out if rc == 0 else None


def _probe() -> bool:
    # Trust the library only if it agrees with F.linear here: fp32 and bf16, every token count up
    # to 16 (every register-tile height of every ISA's micro-kernel), odd sizes, the SwiGLU pairs.
    if _LIB is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(38, 70, generator=gen)
    for t in range(1, 17):
        x, r = torch.randn(1, t, 70, generator=gen), torch.randn(1, t, 38, generator=gen)
        ok = torch.allclose(linear_add(x, w, r), x @ w.T + r, atol=1e-4, rtol=1e-4)
        xb, wb = x.bfloat16(), w.bfloat16()
        ok = ok and torch.allclose(linear(xb, wb).float(), xb.float() @ wb.float().T, atol=0.1, rtol=0.02)
        gate, up = (x @ w.T).chunk(2, dim=-1)
        ok = ok and torch.allclose(swiglu_fused(x, w), torch.nn.functional.silu(gate) * up, atol=1e-4, rtol=1e-4)
        if not ok:
            warnings.warn(f"specbed_kernels.native: results disagree with F.linear ({t} tokens); not used", stacklevel=2)
            return False
    _PACKED.clear()
    return True


AVAILABLE: bool = _probe()
