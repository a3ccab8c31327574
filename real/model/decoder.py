"""A compact Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) with a static KV cache.

gpt-fast style: plain PyTorch, weights fused once at load (Q|K|V in ``wqkv``, gate|up in
``w13``), ops called through ``kernels`` so faster versions can be swapped in.

KV cache and positions
----------------------
Each layer owns preallocated ``k_cache``/``v_cache`` ``[max_batch, n_kv_heads, max_seq, head_dim]``.
A forward writes the K/V of its T tokens at the cache *slots* ``input_pos [T]`` and attends over
slots ``[0, S)``: S = ``input_pos[-1] + 1`` with the default causal mask, or ``mask.shape[-1]``
with an explicit mask. Nothing is ever erased: a slot is simply overwritten by the next write,
so rolling back rejected tokens costs nothing (``truncate``).

``kv_len`` is bookkeeping for callers: after a forward it is ``max(input_pos) + 1``; a forward
with ``input_pos=None`` continues at ``kv_len``; ``truncate(n)`` sets it back to n (slots >= n
become garbage that later writes overwrite). The cache itself never reads ``kv_len``.

Token trees: write the tree's nodes to consecutive slots, give their RoPE positions separately
(``position_ids`` = prefix length + depth) and a boolean ``mask [T, S]`` letting each node see the
committed prefix, its ancestors and itself. After verification, ``move_kv`` copies the accepted
nodes' slots down behind the prefix (their keys were rotated at the right positions already).

Training (``real.train.draft``): ``forward(tokens, cache=False)`` neither reads nor writes a
cache: the T tokens attend causally among themselves (or as a ``[T, T]`` mask says), so an
autograd graph never outlives its step and no cache has to be allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

import specbed_kernels as kernels
from specbed_kernels.reference import rope_tables

if TYPE_CHECKING:
    from testbed.config import ModelConfig


@dataclass
class ModelArgs:
    """Architecture of a Llama-family decoder."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    head_dim: int = 0  # 0 = dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling, e.g. {"rope_type": "llama3", ...}
    max_seq_len: int = 8192  # RoPE tables and the largest KV cache
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> ModelArgs:
        """From the experiment's model preset (testbed.config.ModelConfig)."""
        return cls(dim=cfg.hidden, n_layers=cfg.layers, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads,
                   ffn_dim=cfg.ffn, vocab_size=cfg.vocab, head_dim=cfg.head_dim,
                   norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                   max_seq_len=cfg.max_context, tie_embeddings=cfg.tied_embeddings)

    def to_model_config(self, name: str, quant: str = "fp32") -> ModelConfig:
        """The preset describing this architecture (for the sim's cost models, validation)."""
        from testbed.config import ModelConfig

        return ModelConfig(name=name, layers=self.n_layers, hidden=self.dim, heads=self.n_heads,
                           kv_heads=self.n_kv_heads, head_dim=self.head_dim, ffn=self.ffn_dim,
                           vocab=self.vocab_size, tied_embeddings=self.tie_embeddings,
                           max_context=self.max_seq_len, rope_theta=self.rope_theta,
                           norm_eps=self.norm_eps, quant=quant)

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    # Uninitialized: weights come from a checkpoint (or init_random); skipping nn.Linear's
    # Kaiming init saves seconds at load.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class KVCache(nn.Module):
    """One layer's keys and values, ``[max_batch, n_kv_heads, max_seq, head_dim]``, by slot."""

    def __init__(self, max_batch: int, n_kv_heads: int, max_seq: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Write k/v ``[B, Hkv, T, D]`` at slots ``input_pos``; return slots ``[0, kv_len)``."""
        b = k.shape[0]
        kc, vc = self.k_cache[:b], self.v_cache[:b]
        kc.index_copy_(2, input_pos, k)
        vc.index_copy_(2, input_pos, v)
        return kc[:, :, :kv_len], vc[:, :, :kv_len]

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy slots ``src`` to slots ``dst`` (KV compaction after a tree verification)."""
        src, dst = src.to(self.k_cache.device), dst.to(self.k_cache.device)
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = _param(args.qkv_dim, args.dim, dtype=dtype, device=device)
        self.wo = _param(args.dim, args.n_heads * args.head_dim, dtype=dtype, device=device)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, *,
                mask: Tensor | None, kv_len: int | None) -> Tensor:
        """``kv_len`` None: a cache-free forward (the T tokens attend among themselves)."""
        b, t, _ = x.shape
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = kernels.linear(x, self.wqkv).view(b, t, hq + 2 * hkv, d)
        # Q and K rotated in one op (they are adjacent heads of the fused projection).
        qk = kernels.apply_rope(qkv[:, :, : hq + hkv], cos, sin)
        q = qk[:, :, :hq].transpose(1, 2)
        k = qk[:, :, hq:].transpose(1, 2)
        v = qkv[:, :, hq + hkv :].transpose(1, 2)
        if kv_len is not None:
            if self.kv_cache is None:
                raise RuntimeError("KV cache not allocated: call Transformer.setup_cache() first")
            k, v = self.kv_cache.update(input_pos, k, v, kv_len)
        y = kernels.attention(q, k, v, mask)
        return kernels.linear(y.transpose(1, 2).reshape(b, t, hq * d), self.wo)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.w13 = _param(2 * args.ffn_dim, args.dim, dtype=dtype, device=device)  # gate | up
        self.w2 = _param(args.dim, args.ffn_dim, dtype=dtype, device=device)  # down

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(kernels.swiglu_fused(x, self.w13), self.w2)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = args.norm_eps
        self.attention_norm = _param(args.dim, dtype=dtype, device=device)
        self.attention = Attention(args, dtype, device)
        self.ffn_norm = _param(args.dim, dtype=dtype, device=device)
        self.feed_forward = FeedForward(args, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, *,
                mask: Tensor | None, kv_len: int | None) -> Tensor:
        h = _add_residual(self.attention(kernels.rms_norm(x, self.attention_norm, self.eps),
                                         cos, sin, input_pos, mask=mask, kv_len=kv_len), x)
        return _add_residual(self.feed_forward(kernels.rms_norm(h, self.ffn_norm, self.eps)), h)


def _add_residual(out: Tensor, residual: Tensor) -> Tensor:
    # In place on the fresh projection output (no extra allocation), except under autocast
    # (training), where that output is bf16 and must not narrow the fp32 residual stream.
    return out.add_(residual) if out.dtype == residual.dtype else residual + out


class Transformer(nn.Module):
    """Llama-family decoder; see the module docstring for the KV-cache/position conventions.

    Parameters (the state-dict keys ``real.model.weights`` produces): ``tok_embeddings.weight``,
    ``layers.{i}.attention_norm``, ``layers.{i}.attention.wqkv`` (Q|K|V rows),
    ``layers.{i}.attention.wo``, ``layers.{i}.ffn_norm``, ``layers.{i}.feed_forward.w13``
    (gate|up rows), ``layers.{i}.feed_forward.w2``, ``norm``, ``output`` (the same tensor as
    the embedding when tied).
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype, device=device,
                                           _weight=torch.empty(args.vocab_size, args.dim, dtype=dtype, device=device))
        self.tok_embeddings.weight.requires_grad_(False)
        self.layers = nn.ModuleList(TransformerBlock(args, dtype, device) for _ in range(args.n_layers))
        self.norm = _param(args.dim, dtype=dtype, device=device)
        self.output = self.tok_embeddings.weight if args.tie_embeddings else \
            _param(args.vocab_size, args.dim, dtype=dtype, device=device)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, theta=args.rope_theta, scaling=args.rope_scaling, dtype=dtype)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin_signed", sin.to(device), persistent=False)
        self.kv_len = 0
        self.max_seq = 0  # 0 until setup_cache
        self.cache_epoch = 0  # bumped by every setup_cache (new KVCache modules)
        # Set by real.model.tp.apply_tp on a tensor-parallel rank (kernels.allreduce.AllReduce): the
        # per-layer sums run as module hooks; a kernel fusing several layers must call it too.
        self.tp_allreduce = None
        self.tp_vocab: tuple[int, int] | None = None  # (lo, hi): this rank's LM-head rows under TP
        # real.model.cuda_graphs.GraphedForwards when chain forwards replay CUDA graphs (real.runtime.loading)
        self.graph_forwards = None
        # real.model.batch_graphs.GraphedBatches when batched chain forwards replay CUDA graphs
        self.graph_batches = None
        # A feature-level draft (real.model.eagle) reads the last layer's output of the last forward
        # through all the layers (pre-norm, [B, T, dim]); kept only when it asks.
        self.keep_hidden = False
        self.last_hidden: Tensor | None = None

    # ------------------------------------------------------------------------------ setup
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def init_random(self, seed: int = 0, std: float = 0.02) -> Transformer:
        """Random weights (tests, benchmarks without a checkpoint); norms set to 1."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm"):
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def setup_cache(self, max_seq: int | None = None, max_batch: int = 1,
                    layers: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)allocate zeroed KV caches for ``max_seq`` slots (default: the model's max) for the
        layers in ``[lo, hi)`` (default: all; a pipeline stage allocates only its own)."""
        max_seq = min(max_seq or self.args.max_seq_len, self.args.max_seq_len)
        lo, hi = layers or (0, self.args.n_layers)
        for i, layer in enumerate(self.layers):
            # the layer's own K/V heads: a tensor-parallel rank holds only some (real.model.tp)
            layer.attention.kv_cache = KVCache(max_batch, layer.attention.n_kv_heads, max_seq, self.args.head_dim,
                                               dtype=dtype or self.dtype, device=self.device) if lo <= i < hi else None
        self.max_seq, self.kv_len = max_seq, 0
        self.cache_epoch += 1  # tells kernels that cached pointers to the old caches are stale

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` slots: free, later writes overwrite the rest."""
        if not 0 <= n <= self.max_seq:
            raise ValueError(f"truncate({n}): kv_len must be in [0, {self.max_seq}]")
        self.kv_len = n

    def move_kv(self, src: Tensor, dst: Tensor) -> None:
        """Copy cache slots ``src`` to ``dst`` in every allocated layer (tree KV compaction)."""
        for layer in self.layers:
            if layer.attention.kv_cache is not None:
                layer.attention.kv_cache.move(src, dst)

    # ------------------------------------------------------------------------------ steps
    def embed(self, tokens: Tensor) -> Tensor:
        """tokens ``[B, T]`` -> hidden states ``[B, T, dim]``."""
        return self.tok_embeddings(tokens.to(self.device, non_blocking=True))

    def head(self, h: Tensor) -> Tensor:
        """Final norm + LM head: hidden ``[B, T, dim]`` -> fp32 logits ``[B, T, vocab]``."""
        logits = kernels.linear(kernels.rms_norm(h, self.norm, self.args.norm_eps), self.output).float()
        if self.tp_vocab is None:
            return self._to_host(logits)
        # a tensor-parallel rank holds vocabulary rows [lo, hi) (real.model.tp): its logits in place,
        # zeros elsewhere, summed over the ranks
        lo, hi = self.tp_vocab
        full = logits.new_zeros(*logits.shape[:-1], self.args.vocab_size)
        full[..., lo:hi] = logits
        return self._to_host(self.tp_allreduce(full))

    def _to_host(self, logits: Tensor) -> Tensor:
        """Logits leave a GPU here, once per forward: every caller decides on them next (a
        token, an acceptance), and the algorithms of testbed/spec run on the host. Training
        (autograd on) keeps them where they are."""
        if logits.device.type == "cpu" or torch.is_grad_enabled():
            return logits
        return logits.cpu()

    def _positions(self, t: int, input_pos: Tensor | int | None) -> tuple[Tensor, int, int]:
        """(slots on the model's device, the last slot, the highest slot + 1), the two ints read
        on the host: on a GPU, reading them from a device tensor would wait for every kernel
        queued before this forward (callers pass host tensors or an int)."""
        if input_pos is None:
            input_pos = self.kv_len
        if isinstance(input_pos, int):
            last = input_pos + t - 1
            return torch.arange(input_pos, input_pos + t, device=self.device), last, last + 1
        last, high = int(input_pos[-1]), int(input_pos.max()) + 1
        return input_pos.to(self.device, non_blocking=True), last, high

    def forward_layers(self, h: Tensor, input_pos: Tensor | int | None = None, mask: Tensor | None = None,
                       *, lo: int = 0, hi: int | None = None, position_ids: Tensor | None = None,
                       cache: bool = True) -> Tensor:
        """Run layers ``[lo, hi)`` on hidden states ``h [B, T, dim]``.

        ``input_pos``: cache slots ``[T]`` (or the first slot as an int; None = ``kv_len``).
        ``position_ids``: RoPE positions ``[T]`` when they differ from the slots (trees).
        ``mask``: bool ``[T, S]`` / ``[B, 1, T, S]``, True = attend, over slots ``[0, S)``;
        None = causal (token i sees slots ``<= input_pos[i]``), which assumes that the slots
        before ``input_pos[0]`` hold the committed prefix.
        ``cache=False``: no cache is read or written (training): the tokens are slots
        ``0..T-1`` of their own (``input_pos`` must be None), ``mask`` ``[T, T]`` or causal;
        ``kv_len`` is left alone.
        """
        hi = self.args.n_layers if hi is None else hi
        h = h.to(self.device, non_blocking=True)  # a pipeline stage's input arrives on the host
        t = h.shape[1]
        if not cache and input_pos is not None:
            raise ValueError("cache=False writes no cache slots: pass RoPE positions as position_ids, "
                             "not input_pos")
        pos, last, high = self._positions(t, input_pos if cache else 0)
        rope_pos = pos if position_ids is None else position_ids.to(self.device, non_blocking=True)
        cos, sin = self.rope_cos[rope_pos], self.rope_sin_signed[rope_pos]
        if mask is None:
            kv_len, high = last + 1, last + 1
            if t > 1:
                mask = torch.arange(kv_len, device=h.device)[None, :] <= pos[:, None]
        else:
            mask = mask.to(self.device, non_blocking=True)
            kv_len = mask.shape[-1]
            if high > kv_len:
                raise ValueError(f"mask covers {kv_len} slots but a token is written at slot {high - 1}")
        if not cache:
            for layer in self.layers[lo:hi]:
                h = layer(h, cos, sin, pos, mask=mask, kv_len=None)
            return h
        if high > self.max_seq:
            raise ValueError(f"slot {high - 1} is beyond the KV cache ({self.max_seq} slots; "
                             "call setup_cache with a larger max_seq)")
        # One native call for all the layers where it applies (batch 1, <= 8 tokens on CPU: the
        # per-op dispatch overhead exceeds the weight streaming time otherwise); else op by op.
        fused = kernels.decode_layers(self, lo, hi, h, cos=cos, sin=sin, pos=pos, mask=mask, kv_len=kv_len)
        if fused is not None:
            h = fused
        else:
            for layer in self.layers[lo:hi]:
                h = layer(h, cos, sin, pos, mask=mask, kv_len=kv_len)
        self.kv_len = high
        if self.keep_hidden and hi == self.args.n_layers:
            self.last_hidden = h
        return h

    def forward(self, x: Tensor, input_pos: Tensor | int | None = None, mask: Tensor | None = None,
                position_ids: Tensor | None = None, *, layers: tuple[int, int] | None = None,
                cache: bool = True) -> Tensor:
        """Tokens ``[B, T]`` -> fp32 logits ``[B, T, vocab]`` (see ``forward_layers`` for the
        arguments). With ``layers=(lo, hi)`` (a pipeline stage) the input is tokens only when
        lo == 0 (hidden states ``[B, T, dim]`` otherwise) and the output is logits only when
        hi == n_layers (hidden states otherwise)."""
        lo, hi = layers or (0, self.args.n_layers)
        h = self.embed(x) if lo == 0 else x
        h = self.forward_layers(h, input_pos, mask, lo=lo, hi=hi, position_ids=position_ids, cache=cache)
        return self.head(h) if hi == self.args.n_layers else h

    def early_exit(self, tokens: Tensor, n_layers: int, input_pos: Tensor | int | None = None,
                   mask: Tensor | None = None, *, position_ids: Tensor | None = None) -> Tensor:
        """Logits after only the first ``n_layers`` layers (final norm + LM head applied): the
        early-exit draft. It writes the same K/V the full model would for those layers, so it
        can share the target's cache."""
        h = self.forward_layers(self.embed(tokens), input_pos, mask, lo=0, hi=n_layers, position_ids=position_ids)
        return self.head(h)
