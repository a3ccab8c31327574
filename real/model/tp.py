"""Tensor parallelism: shard a loaded ``real.model.decoder.Transformer`` in place for one rank of a group.

Megatron style, as gpt-fast's tp.py: the fused Q|K|V projection (``wqkv``) and gate|up
(``w13``) are split by output rows ("columns" of the math), the output (``wo``) and down
(``w2``) projections by input columns, and one all-reduce after each of ``wo`` and ``w2`` sums
the ranks' partial outputs (before the residual add, so the residual counts once). Embedding
and norms are replicated. The LM head is split by vocabulary (each rank reads its share of the
113 MB fp32 head, the largest matrix of SmolLM2-135M) and its logits are gathered with one
all-reduce of the zero-padded rows, so every rank ends a forward with the same full logits.

Heads go by KV-head groups (a KV head and the query heads that share it stay together),
unevenly where they do not divide: SmolLM2-135M (9 query / 3 KV heads) at TP=2 puts 2 groups
(6 query heads) on rank 0 and 1 group (3) on rank 1. The FFN is split as evenly as possible.
Each rank's KV cache holds only its own KV heads.

The all-reduce is pluggable (``specbed_kernels.allreduce``): "gloo" (``dist.all_reduce`` on the group)
or "shm" (same-host shared memory, much lower latency on CPU). The op-by-op path sums in module
forward hooks; the fused native decode path (``specbed_kernels.native.decode_layers``) calls the
backend's native function between its layers (``model.tp_allreduce``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from real.model.decoder import ModelArgs, Transformer
from specbed_kernels.allreduce import AllReduce, make


def even_split(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` near-equal counts, the larger ones first (7, 3 -> 3, 2, 2)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass(frozen=True)
class Shard:
    """What one rank holds of every layer: ``[start, stop)`` of the KV heads, query heads and
    FFN rows (the same ranges in every layer)."""

    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    ffn: tuple[int, int]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def ffn_dim(self) -> int:
        return self.ffn[1] - self.ffn[0]


def plan_shards(args: ModelArgs, world: int) -> list[Shard]:
    """Every rank's shard: KV-head groups and FFN rows split as evenly as possible."""
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world}")
    if args.n_kv_heads < world:
        raise ValueError(f"TP={world} needs at least {world} KV heads (a rank holds whole KV-head "
                         f"groups); this model has {args.n_kv_heads}: use TP <= {args.n_kv_heads}")
    rep = args.n_heads // args.n_kv_heads
    shards, kv0, f0 = [], 0, 0
    for n_kv, n_ffn in zip(even_split(args.n_kv_heads, world), even_split(args.ffn_dim, world), strict=True):
        shards.append(Shard((kv0, kv0 + n_kv), (kv0 * rep, (kv0 + n_kv) * rep), (f0, f0 + n_ffn)))
        kv0, f0 = kv0 + n_kv, f0 + n_ffn
    return shards


def _rows(w: Tensor, lo: int, hi: int, unit: int = 1) -> Tensor:
    return w[lo * unit:hi * unit]


def _shard_attention(att: nn.Module, args: ModelArgs, s: Shard) -> None:
    d, hq, hkv = args.head_dim, args.n_heads, args.n_kv_heads
    q, k, v = att.wqkv.data.split([hq * d, hkv * d, hkv * d])
    att.wqkv.data = torch.cat([_rows(q, *s.q_heads, d), _rows(k, *s.kv_heads, d),
                               _rows(v, *s.kv_heads, d)]).contiguous()
    att.wo.data = att.wo.data[:, s.q_heads[0] * d:s.q_heads[1] * d].contiguous()
    att.n_heads, att.n_kv_heads = s.n_heads, s.n_kv_heads


def _shard_ffn(ffn: nn.Module, args: ModelArgs, s: Shard) -> None:
    gate, up = ffn.w13.data.split([args.ffn_dim, args.ffn_dim])
    ffn.w13.data = torch.cat([_rows(gate, *s.ffn), _rows(up, *s.ffn)]).contiguous()
    ffn.w2.data = ffn.w2.data[:, s.ffn[0]:s.ffn[1]].contiguous()


def _sum_hook(allreduce: AllReduce):
    def hook(_module: nn.Module, _inputs: tuple, output: Tensor) -> Tensor:
        return allreduce(output)
    return hook


def _shard_head(model: Transformer, rank: int, world: int) -> None:
    # this rank's rows of the LM head (a copy: the embedding it may be tied to stays whole)
    vocab = model.output.shape[0]
    bounds = [0]
    for n in even_split(vocab, world):
        bounds.append(bounds[-1] + n)
    lo, hi = bounds[rank], bounds[rank + 1]
    model.output = nn.Parameter(model.output.detach()[lo:hi].clone(), requires_grad=False)
    model.tp_vocab = (lo, hi)


def apply_tp(model: Transformer, *, rank: int, world: int, group: dist.ProcessGroup | None = None,
             allreduce: str | AllReduce = "shm") -> Transformer:
    """Shard ``model`` (every rank loaded the same full weights) in place as rank ``rank`` of
    ``world``; returns it. ``allreduce``: "shm", "gloo" (then constructed on ``group``, which makes
    this call collective: every rank of the group calls it together) or a ready backend.

    KV caches that were allocated are reallocated (zeroed, same slots and batch) with this rank's
    heads. ``world == 1`` leaves the model untouched. Shard before any forward; once only."""
    if world == 1:
        return model
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    if model.tp_allreduce is not None:
        raise RuntimeError("apply_tp: this model is already sharded")
    if isinstance(allreduce, str):
        # on a GPU the group's collective is NCCL's (dist.all_reduce on device tensors); the
        # shared-memory backend sums host memory
        allreduce = make("gloo" if model.device.type == "cuda" else allreduce, group)
    if (allreduce.rank, allreduce.world) != (rank, world):
        raise ValueError(f"the all-reduce is rank {allreduce.rank} of {allreduce.world}, "
                         f"apply_tp was told rank {rank} of {world}")
    shard = plan_shards(model.args, world)[rank]
    hook = _sum_hook(allreduce)
    for layer in model.layers:
        _shard_attention(layer.attention, model.args, shard)
        _shard_ffn(layer.feed_forward, model.args, shard)
        layer.attention.register_forward_hook(hook)
        layer.feed_forward.register_forward_hook(hook)
    model.tp_allreduce = allreduce
    _shard_head(model, rank, world)
    cache = next((layer.attention.kv_cache for layer in model.layers if layer.attention.kv_cache is not None), None)
    if cache is not None:  # the heads changed: the same slots, this rank's heads only
        lo = next(i for i, layer in enumerate(model.layers) if layer.attention.kv_cache is not None)
        hi = lo + sum(layer.attention.kv_cache is not None for layer in model.layers)
        model.setup_cache(model.max_seq, max_batch=cache.k_cache.shape[0], layers=(lo, hi),
                          dtype=cache.k_cache.dtype)
    return model
