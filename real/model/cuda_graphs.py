"""CUDA-graph replay of a model's chain forwards: decode steps, draft steps and verification
windows of up to ``MAX_TOKENS`` tokens at any slot (gpt-fast's approach).

Why: eager PyTorch launches ~40 kernels per decoder layer; on an H200 the 1 B target of the GPU
check takes 6-12 ms per forward eager and 1.5-1.9 ms replayed from a graph, for every k from 1 to
16 (docs/gpu.md). A graph needs static shapes, so the captured forward attends over the whole
KV cache with a mask built on the device from the slot tensor (masked slots add exactly zero),
and its inputs (tokens, slots) are copied into fixed buffers before each replay. One graph per
token count k, captured on first use, all sharing one memory pool; ``setup_cache`` (new cache
buffers) drops them. Trees, pipeline stages and tensor-parallel ranks keep the eager forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels

MAX_TOKENS = 16


class GraphedForwards:
    """``logits(tokens, start)``: host fp32 logits ``[k, V]`` of a chain forward, replayed."""

    def __init__(self, model) -> None:  # model: real.model.decoder.Transformer
        self.model = model
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self._epoch = model.cache_epoch
        self._pool = None
        self.replays = 0

    @staticmethod
    def applies(model) -> bool:
        return (model.device.type == "cuda" and model.tp_allreduce is None and model.tp_vocab is None
                and model.max_seq > 0  # and not a pipeline stage, whose cache covers some layers
                and all(layer.attention.kv_cache is not None for layer in model.layers))

    def static_logits(self, tokens: Tensor, slots: Tensor) -> Tensor:
        """The captured body, on the device, no host sync: tokens ``[1, k]``, slots ``[k]``
        (consecutive, the committed prefix before them) -> fp32 logits ``[k, V]``. Runs eagerly
        too (the tests compare it with ``Transformer.forward`` on the CPU)."""
        m = self.model
        h = m.tok_embeddings(tokens)
        cos, sin = m.rope_cos[slots], m.rope_sin_signed[slots]
        mask = torch.arange(m.max_seq, device=slots.device)[None, :] <= slots[:, None]
        for layer in m.layers:
            h = layer(h, cos, sin, slots, mask, m.max_seq)
        return kernels.linear(kernels.rms_norm(h, m.norm, m.args.norm_eps), m.output)[0].float()

    def logits(self, tokens: list[int], start: int) -> Tensor | None:
        """None where a graph does not apply (too many tokens, beyond the cache)."""
        m, k = self.model, len(tokens)
        if not 0 < k <= MAX_TOKENS or start + k > m.max_seq or not self.applies(m):
            return None
        if m.cache_epoch != self._epoch:  # new cache buffers: the graphs point at the old ones
            self._graphs.clear()
            self._epoch = m.cache_epoch
        if k not in self._graphs:
            self._graphs[k] = self._capture(k)
        graph, tok_buf, slot_buf, out = self._graphs[k]
        tok_buf.copy_(torch.tensor([tokens], dtype=torch.long), non_blocking=True)
        slot_buf.copy_(torch.arange(start, start + k), non_blocking=True)
        graph.replay()
        m.kv_len = start + k
        self.replays += 1
        return out.cpu()

    def _capture(self, k: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]:
        m = self.model
        tok_buf = torch.zeros(1, k, dtype=torch.long, device=m.device)
        slot_buf = torch.arange(k, device=m.device)  # warm-up writes slots 0..k-1: re-written later
        saved = m.kv_len
        # the warm-up really runs and writes K/V at slots 0..k-1, which hold the prefix of the
        # request being served: keep them and put them back afterwards
        caches = [c for layer in m.layers if (kv := layer.attention.kv_cache) is not None
                  for c in (kv.k_cache, kv.v_cache)]
        kept = [c[:, :, :k].clone() for c in caches]
        stream = torch.cuda.Stream(m.device)
        stream.wait_stream(torch.cuda.current_stream(m.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up off the capture: cuBLAS handles, workspace
                self.static_logits(tok_buf, slot_buf)
        torch.cuda.current_stream(m.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            out = self.static_logits(tok_buf, slot_buf)
        for c, old in zip(caches, kept):
            c[:, :, :k].copy_(old)
        m.kv_len = saved
        return graph, tok_buf, slot_buf, out
