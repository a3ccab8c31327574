"""CUDA-graph replay of batched forwards (continuous batching on a GPU, real/runtime/batching.py).

Why: on the CPU a batched forward is one native call (real/model/batch.py); on a GPU its eager
form launches every op per layer and attends feed by feed — 73.6 ms a round of 4 requests on the
H200 of the GPU check against 11.7 ms for one request replayed from a graph (docs/gpu.md). A
graph needs static shapes, so a batch is padded: to the next of ``BATCHES`` requests (the extra
entries write junk into the prefill row 0, which a prefill rewrites before it is copied) and
to the longest feed's token count T (a shorter feed's extra tokens write its own slots past its
last token, which the next forward of that row rewrites before it reads them: a forward writes
its K/V before it attends, and never attends past its own slot). Every request attends over its
whole KV-cache row with a mask over every slot, as the one-request graphs do
(real/model/cuda_graphs.py); inputs are copied into fixed buffers before each replay. One graph
per (padded batch, T); chains only (a token tree's feeds run eagerly), up to ``MAX_TOKENS``
tokens a feed; ``setup_cache`` (new cache buffers) drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

import specbed_kernels as kernels
from real.model.cuda_graphs import MAX_TOKENS

if TYPE_CHECKING:
    from real.model.batch import Feed

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def static_batch_logits(model, tokens: Tensor, slots: Tensor, rows: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    """The captured body, on the device, no host sync: ``tokens`` and ``slots`` ``[B, T]`` of B
    chains written at those slots of KV-cache rows ``rows [B]`` -> fp32 logits ``[B, T, V]``.
    Runs eagerly too (the tests compare it with ``forward_batch`` on the CPU)."""
    m = model
    b, t = tokens.shape
    flat_slots, flat_rows = slots.reshape(-1), rows[:, None].expand(b, t).reshape(-1)
    h = m.tok_embeddings(tokens.reshape(1, -1))
    cos, sin = m.rope_cos[flat_slots], m.rope_sin_signed[flat_slots]
    mask = (torch.arange(m.max_seq, device=slots.device)[None, None, :] <= slots[:, :, None])[:, None]
    for layer in m.layers:
        att, ffn = layer.attention, layer.feed_forward
        hq, hkv, d = att.n_heads, att.n_kv_heads, att.head_dim
        x = kernels.rms_norm(h, layer.attention_norm, layer.eps)
        qkv = kernels.linear(x, att.wqkv).view(1, b * t, hq + 2 * hkv, d)
        qk = kernels.apply_rope(qkv[:, :, : hq + hkv], cos, sin)
        kc, vc = att.kv_cache.k_cache, att.kv_cache.v_cache
        kc[flat_rows, :, flat_slots] = qk[0, :, hq:].to(kc.dtype)  # [B·T, Hkv, D] at (row, slot)
        vc[flat_rows, :, flat_slots] = qkv[0, :, hq + hkv:].to(vc.dtype)
        q = qk[0, :, :hq].view(b, t, hq, d).transpose(1, 2)
        y = kernels.attention(q, kc.index_select(0, rows).to(q.dtype), vc.index_select(0, rows).to(q.dtype), mask)
        h = kernels.linear(y.transpose(1, 2).reshape(1, b * t, hq * d), att.wo).add_(h)
        h = kernels.linear(kernels.swiglu_fused(kernels.rms_norm(h, layer.ffn_norm, layer.eps), ffn.w13),
                           ffn.w2).add_(h)
    logits = kernels.linear(kernels.rms_norm(h, m.norm, m.args.norm_eps), m.output)
    return logits.view(b, t, -1).float()


class GraphedBatches:
    """``logits(feeds)``: each chain feed's host fp32 logits ``[T_i, V]``, replayed; None where
    a graph does not apply (a tree's mask or positions, a feed over ``MAX_TOKENS`` tokens or
    past the cache, more requests than the largest batch)."""

    def __init__(self, model) -> None:  # model: real.model.decoder.Transformer
        self.model = model
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        self._epoch = model.cache_epoch
        self.replays = 0
        self.captures = 0

    def _shape(self, feeds: list[Feed]) -> tuple[int, int] | None:
        from real.model.cuda_graphs import GraphedForwards

        if not GraphedForwards.applies(self.model):
            return None
        if any(f.mask is not None or f.slots is not None or f.positions is not None for f in feeds):
            return None
        t = max(len(f.tokens) for f in feeds)
        batch = next((b for b in BATCHES if b >= len(feeds)), None)
        if batch is None or t > MAX_TOKENS or max(f.start for f in feeds) + t > self.model.max_seq:
            return None
        if self.model.cache_epoch != self._epoch:  # new cache buffers: the graphs point at the old ones
            self._graphs.clear()
            self._epoch = self.model.cache_epoch
        return batch, t

    def logits(self, feeds: list[Feed]) -> list[Tensor] | None:
        shape = self._shape(feeds)
        if shape is None:
            return None
        batch, t = shape
        tokens = torch.zeros(batch, t, dtype=torch.long)
        slots = torch.arange(t).repeat(batch, 1)  # the padding entries: row 0, slots 0..t-1
        rows = torch.zeros(batch, dtype=torch.long)
        for i, f in enumerate(feeds):
            tokens[i, :len(f.tokens)] = torch.tensor(f.tokens)
            slots[i] += f.start
            rows[i] = f.row
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(*shape)
        graph, buffers, out = self._graphs[shape]
        for name, value in (("tokens", tokens), ("slots", slots), ("rows", rows)):
            buffers[name].copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        host = out.cpu()
        return [host[i, :len(f.tokens)] for i, f in enumerate(feeds)]

    def prepare(self, batches: int, counts: list[int]) -> None:
        """Capture the graphs for up to ``batches`` requests of these token counts now, before a
        run's timed rounds."""
        from real.model.cuda_graphs import GraphedForwards

        if not GraphedForwards.applies(self.model):
            return
        for b in BATCHES:
            for t in counts:
                if (b, t) not in self._graphs and 0 < t <= MAX_TOKENS:
                    self._graphs[(b, t)] = self._capture(b, t)
            if b >= batches:
                break

    def _capture(self, batch: int, t: int) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]:
        m = self.model
        dev = m.device
        # the warm-up and the capture really run: they write row 0 (the prefill row) at slots
        # 0..t-1, which no request reads
        buffers = {"tokens": torch.zeros(batch, t, dtype=torch.long, device=dev),
                   "slots": torch.arange(t, device=dev).repeat(batch, 1),
                   "rows": torch.zeros(batch, dtype=torch.long, device=dev)}
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up off the capture: cuBLAS handles, workspace
                static_batch_logits(m, **buffers)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        forwards = m.graph_forwards
        pool = getattr(forwards, "_pool", None) or torch.cuda.graph_pool_handle()
        if forwards is not None and forwards._pool is None:
            forwards._pool = pool  # one memory pool for every graph of the model
        with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
            out = static_batch_logits(m, **buffers)
        self.captures += 1
        return graph, buffers, out
