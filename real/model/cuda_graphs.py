"""CUDA-graph replay of a model's forwards: decode steps, draft steps, verification windows and
tree-masked forwards (token-tree verification, draft expansions) of up to ``MAX_TOKENS`` tokens
at any slot (gpt-fast's approach).

Why: eager PyTorch launches ~40 kernels per decoder layer; on an H200 the 1 B target of the GPU
check takes 6-12 ms per forward eager and 1.5-1.9 ms replayed from a graph, for every k from 1 to
16 (docs/gpu.md). A graph needs static shapes, so the captured forward attends over the whole
KV cache with a mask over every slot (masked slots add exactly zero), and its inputs (tokens,
slots, and for trees the RoPE positions and the mask) are copied into fixed buffers before each
replay. A chain's mask is built on the device from the slot tensor; a tree's comes from the host.
One graph per (kind, token count), all sharing one memory pool; ``prepare`` captures them before
a run's timed requests (a capture costs ~3 eager forwards), ``setup_cache`` (new cache buffers)
drops them. Pipeline stages and tensor-parallel ranks keep the eager forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

import specbed_kernels as kernels

MAX_TOKENS = 16
CHAIN, TREE = "chain", "tree"


class GraphedForwards:
    """``logits(tokens, start)`` / ``tree_logits(...)``: fp32 logits ``[k, V]``, replayed; on the
    host (a tree's may stay on the device: ``to_host=False``)."""

    def __init__(self, model) -> None:  # model: real.model.decoder.Transformer
        self.model = model
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        self._epoch = model.cache_epoch
        self._pool = None
        self.replays = 0
        self.captures = 0

    @staticmethod
    def applies(model) -> bool:
        return (model.device.type == "cuda" and model.tp_allreduce is None and model.tp_vocab is None
                and model.max_seq > 0  # and not a pipeline stage, whose cache covers some layers
                and all(layer.attention.kv_cache is not None for layer in model.layers))

    def static_logits(self, tokens: Tensor, slots: Tensor, positions: Tensor | None = None,
                      mask: Tensor | None = None) -> Tensor:
        """The captured body, on the device, no host sync: tokens ``[1, k]``, slots ``[k]``; a
        chain (``mask`` None) has consecutive slots after the committed prefix and RoPE
        positions = slots; a tree passes ``positions [k]`` and ``mask [k, max_seq]`` (True =
        attend) -> fp32 logits ``[k, V]``. Runs eagerly too (the tests compare it with
        ``Transformer.forward`` on the CPU)."""
        m = self.model
        h = m.tok_embeddings(tokens)
        rope = slots if positions is None else positions
        cos, sin = m.rope_cos[rope], m.rope_sin_signed[rope]
        if mask is None:
            mask = torch.arange(m.max_seq, device=slots.device)[None, :] <= slots[:, None]
        for layer in m.layers:
            h = layer(h, cos, sin, slots, mask=mask, kv_len=m.max_seq)
        return kernels.linear(kernels.rms_norm(h, m.norm, m.args.norm_eps), m.output)[0].float()

    def _usable(self, k: int, high: int) -> bool:
        if not 0 < k <= MAX_TOKENS or high > self.model.max_seq or not self.applies(self.model):
            return False
        if self.model.cache_epoch != self._epoch:  # new cache buffers: the graphs point at the old ones
            self._graphs.clear()
            self._epoch = self.model.cache_epoch
        return True

    def logits(self, tokens: list[int], start: int) -> Tensor | None:
        """A chain forward at slots ``start..``; None where a graph does not apply (too many
        tokens, beyond the cache)."""
        k = len(tokens)
        if not self._usable(k, start + k):
            return None
        return self._replay((CHAIN, k), start + k, True, tokens=torch.tensor([tokens], dtype=torch.long),
                            slots=torch.arange(start, start + k))

    def tree_logits(self, tokens: Sequence[int], *, input_pos: Tensor, mask: Tensor,
                    position_ids: Tensor, to_host: bool = True) -> Tensor | None:
        """A tree-masked forward (``Transformer.forward``'s arguments: ``mask [k, S]`` over
        slots ``[0, S)``); None where a graph does not apply. ``to_host=False``: the logits stay
        on the device (a copy of the graph's output, which the next replay overwrites)."""
        k, width = len(tokens), mask.shape[-1]
        high = int(input_pos.max()) + 1
        if not self._usable(k, max(high, width)):
            return None
        full = torch.zeros(k, self.model.max_seq, dtype=torch.bool)
        full[:, :width] = mask
        return self._replay((TREE, k), high, to_host, tokens=torch.tensor([list(tokens)], dtype=torch.long),
                            slots=input_pos, positions=position_ids, mask=full)

    def prepare(self, counts: Iterable[int], *, tree: bool = False) -> None:
        """Capture the chain graphs (and the tree graphs) for these token counts now, before a
        run's timed requests, so no capture lands inside a measured round."""
        for k in counts:
            if self._usable(k, k):
                for kind in (CHAIN, TREE) if tree else (CHAIN,):
                    if (kind, k) not in self._graphs:
                        self._graphs[(kind, k)] = self._capture(kind, k)

    def _replay(self, key: tuple[str, int], high: int, to_host: bool, **inputs: Tensor) -> Tensor:
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, buffers, out = self._graphs[key]
        for name, value in inputs.items():
            buffers[name].copy_(value, non_blocking=True)
        graph.replay()
        self.model.kv_len = high
        self.replays += 1
        return out.cpu() if to_host else out.clone()

    def _capture(self, kind: str, k: int) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]:
        m = self.model
        buffers = {"tokens": torch.zeros(1, k, dtype=torch.long, device=m.device),
                   "slots": torch.arange(k, device=m.device)}  # warm-up writes slots 0..k-1: re-written later
        if kind == TREE:
            buffers["positions"] = torch.arange(k, device=m.device)
            buffers["mask"] = torch.arange(m.max_seq, device=m.device)[None, :] <= buffers["slots"][:, None]
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
                self.static_logits(**buffers)
        torch.cuda.current_stream(m.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            out = self.static_logits(**buffers)
        for c, old in zip(caches, kept):
            c[:, :, :k].copy_(old)
        m.kv_len = saved
        self.captures += 1
        return graph, buffers, out
