"""Forwards over the rows of several requests at once (continuous batching, real/runtime/batching.py).

Every request in flight owns one batch row of the model's KV cache (``CacheRows``); a batched
forward takes one ``Feed`` per request (its tokens, the slot of the first, optionally a tree mask)
and returns each request's logits. The rows of all requests go through every weight matrix
together (the weights are read once per forward, as in a k-token verification); attention stays
per request, over its own cache row and length. On the CPU the whole run of layers is one native
call (``specbed_kernels.native.batch_layers``, groups of up to ``MAX_TOKENS`` rows); elsewhere, and as
the tests' oracle, the same computation op by op (``reference_layers``).

Batch invariance: the native kernels compute each row the same way whatever else shares the
call (specbed_kernels/native.cpp), so a request's logits in a batch equal its logits served alone, bit
for bit, and greedy decoding under load reproduces batch-1 `ar` token for token.

Row 0 of the cache is the prefill row: a prompt is prefilled there with the model's own batch-1
forward (``real.model.runners.prefill``, exactly as a request served alone) and its slots are then
copied to the request's row, so requests occupy rows 1..max_batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import specbed_kernels as kernels
from real.model.decoder import Transformer
from real.model.runners import prefill
from specbed_kernels import native


@dataclass(frozen=True)
class Feed:
    """One request's part of a batched forward: ``tokens`` written at slots ``start..`` of cache
    row ``row`` (or at ``slots``, a token tree's), rotated at those positions (or at
    ``positions``); ``mask`` (bool ``[T, S]``) lets token t see slot s, else causal by slot."""

    row: int
    tokens: list[int]
    start: int = 0
    mask: Tensor | None = None
    slots: list[int] | None = None
    positions: list[int] | None = None

    @property
    def cache_slots(self) -> list[int]:
        return self.slots if self.slots is not None else list(range(self.start, self.start + len(self.tokens)))

    @property
    def kv_len(self) -> int:
        return self.mask.shape[-1] if self.mask is not None else max(self.cache_slots) + 1


class CacheRows:
    """The batch rows of ``model``'s KV cache: ``max_batch`` request rows plus the prefill row."""

    def __init__(self, model: Transformer, max_batch: int, max_seq: int) -> None:
        self.model, self.max_batch = model, max_batch
        model.setup_cache(max_seq, max_batch=max_batch + 1)
        self.free = list(range(max_batch, 0, -1))

    def acquire(self) -> int:
        if not self.free:
            raise RuntimeError(f"all {self.max_batch} cache rows are in use")
        return self.free.pop()

    def release(self, row: int) -> None:
        self.free.append(row)

    @torch.inference_mode()
    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy slots ``src`` to ``dst`` of one row in every layer (a token tree's KV compaction)."""
        if not src:
            return
        s, d = torch.tensor(src, device=self.model.device), torch.tensor(dst, device=self.model.device)
        for layer in self.model.layers:
            cache = layer.attention.kv_cache
            if cache is not None:
                for c in (cache.k_cache[row], cache.v_cache[row]):
                    c.index_copy_(1, d, c.index_select(1, s))

    @torch.inference_mode()
    def prefill(self, row: int, tokens: list[int], *, last_logits: bool = False,
                every_logit: bool = False) -> Tensor | None:
        """Cache ``tokens`` in slots ``0..n-1`` of ``row`` as a batch-1 prefill would; with
        ``every_logit`` return the fp32 logits after every token ``[n, V]`` (a teacher's)."""
        logits = prefill(self.model, tokens, last_logits=last_logits, every_logit=every_logit)
        copy_prefix(self.model, row, len(tokens))
        return logits


@torch.inference_mode()
def copy_prefix(model: Transformer, row: int, n: int) -> None:
    """Copy slots ``0..n-1`` of the prefill row (0) to ``row`` in every layer with a cache (a
    pipeline stage: only its own)."""
    for layer in model.layers:
        cache = layer.attention.kv_cache
        if cache is not None and n:
            cache.k_cache[row, :, :n] = cache.k_cache[0, :, :n]
            cache.v_cache[row, :, :n] = cache.v_cache[0, :, :n]


@torch.inference_mode()
def forward_batch(model: Transformer, feeds: list[Feed], *, layers: int | None = None) -> list[Tensor]:
    """fp32 logits ``[T_i, V]`` of every feed (on the host), the rows of all feeds in one forward
    per group of at most ``specbed_kernels.native.MAX_TOKENS`` rows. ``layers``: only the first that many
    layers, then the final norm and LM head (the early-exit draft, which writes the same K/V as
    the full model in those layers of the request's row). On a GPU chains replay CUDA graphs
    (real/model/batch_graphs.py)."""
    graphs = getattr(model, "graph_batches", None)
    if graphs is not None and layers is None and not model.keep_hidden and feeds:
        out = graphs.logits(feeds)
        if out is not None:
            return out
    return forward_batch_features(model, feeds, layers=layers)[0]


@torch.inference_mode()
def forward_batch_features(model: Transformer, feeds: list[Feed], *,
                           layers: int | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """``forward_batch``'s logits, and every feed's features ``[T_i, dim]``: the last layer's
    output before the final norm, what an eagle head reads (``Transformer.last_hidden``)."""
    sizes = [len(f.tokens) for f in feeds]
    if not feeds or min(sizes) < 1:
        raise ValueError("a batched forward needs at least one token per feed")
    for f in feeds:
        if max(f.cache_slots) >= f.kv_len or len(f.cache_slots) != len(f.tokens):
            raise ValueError(f"feed of row {f.row}: its mask covers {f.kv_len} slots but a token is written "
                             f"at slot {max(f.cache_slots)}")
        if f.kv_len > model.max_seq:
            raise ValueError(f"feed of row {f.row} reaches slot {max(f.kv_len, f.start + len(f.tokens)) - 1}, "
                             f"beyond the KV cache ({model.max_seq} slots)")
    hidden = []
    for group in _groups(feeds, native.MAX_TOKENS if native.AVAILABLE else sum(sizes)):
        hidden.append(_layers(model, group, layers or model.args.n_layers))
    h = torch.cat(hidden, dim=1)
    logits = model.head(h)[0]
    return list(logits.split(sizes)), list(h[0].split(sizes))


def _groups(feeds: list[Feed], max_rows: int) -> list[list[Feed]]:
    """Consecutive feeds, at most ``max_rows`` rows a group (a longer feed alone)."""
    groups: list[list[Feed]] = [[]]
    rows = 0
    for f in feeds:
        if groups[-1] and rows + len(f.tokens) > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(f)
        rows += len(f.tokens)
    return groups


def _layers(model: Transformer, feeds: list[Feed], hi: int) -> Tensor:
    tokens = torch.tensor([[t for f in feeds for t in f.tokens]], device=model.device)
    return layers_rows(model, model.embed(tokens), feeds, lo=0, hi=hi)


@torch.inference_mode()
def layers_rows(model: Transformer, h: Tensor, feeds: list[Feed], *, lo: int, hi: int) -> Tensor:
    """Layers ``[lo, hi)`` on the hidden states ``h [1, R, dim]`` of the feeds' rows (their
    tokens in order; a pipeline stage's share of a forward on a request's cache row)."""
    dev = model.device
    slots = torch.tensor([s for f in feeds for s in f.cache_slots], dtype=torch.long, device=dev)
    rope = torch.tensor([p for f in feeds for p in (f.positions if f.positions is not None else f.cache_slots)],
                        dtype=torch.long, device=dev)
    cos, sin = model.rope_cos[rope], model.rope_sin_signed[rope]
    starts = [0]
    for f in feeds:
        starts.append(starts[-1] + len(f.tokens))
    out = native.batch_layers(model, h, lo=lo, hi=hi, cos=cos, sin=sin, slots=slots, starts=starts,
                              kv_lens=[f.kv_len for f in feeds], cache_rows=[f.row for f in feeds],
                              masks=[f.mask for f in feeds]) if native.AVAILABLE else None
    return out if out is not None else reference_layers(model, h, feeds, lo=lo, hi=hi, cos=cos, sin=sin, slots=slots)


def reference_layers(model: Transformer, h: Tensor, feeds: list[Feed], *, hi: int, cos: Tensor, sin: Tensor,
                     slots: Tensor, lo: int = 0) -> Tensor:
    """The batched layers ``[lo, hi)`` op by op (the registered ``kernels`` ops): the projections
    over all rows, attention per feed over its cache row. What runs off the CPU, and the native
    path's oracle."""
    starts = [0]
    for f in feeds:
        starts.append(starts[-1] + len(f.tokens))
    # a tensor-parallel rank sums its partial outputs of wo and w2 over the group (real/model/tp.py
    # does it in module hooks, which these direct calls bypass)
    total = model.tp_allreduce if model.tp_allreduce is not None else (lambda x: x)
    for layer in model.layers[lo:hi]:
        att, ffn = layer.attention, layer.feed_forward
        hq, hkv, d = att.n_heads, att.n_kv_heads, att.head_dim
        x = kernels.rms_norm(h, layer.attention_norm, layer.eps)
        qkv = kernels.linear(x, att.wqkv).view(1, -1, hq + 2 * hkv, d)
        qk = kernels.apply_rope(qkv[:, :, : hq + hkv], cos, sin)
        ys = []
        for i, f in enumerate(feeds):
            a, b = starts[i], starts[i + 1]
            q = qk[:, a:b, :hq].transpose(1, 2)
            k = qk[:, a:b, hq:].transpose(1, 2)
            v = qkv[:, a:b, hq + hkv:].transpose(1, 2)
            cache = att.kv_cache
            kc, vc = cache.k_cache[f.row:f.row + 1], cache.v_cache[f.row:f.row + 1]
            kc.index_copy_(2, slots[a:b], k.to(kc.dtype))
            vc.index_copy_(2, slots[a:b], v.to(vc.dtype))
            mask = f.mask
            if mask is None and b - a > 1:
                mask = torch.arange(f.kv_len, device=h.device)[None, :] <= slots[a:b, None]
            y = kernels.attention(q, kc[:, :, :f.kv_len], vc[:, :, :f.kv_len],
                                  None if mask is None else mask.to(h.device))
            ys.append(y.transpose(1, 2).reshape(1, b - a, hq * d))
        h = total(kernels.linear(torch.cat(ys, dim=1), att.wo)).add_(h)
        h = total(kernels.linear(kernels.swiglu_fused(kernels.rms_norm(h, layer.ffn_norm, layer.eps), ffn.w13),
                                 ffn.w2)).add_(h)
    return h
