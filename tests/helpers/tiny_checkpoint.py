"""Tiny random-weight Llama checkpoints with the bundled tokenizer, for end-to-end tests of the
real backend (the CLI, the engine, the multi-process runtime) that must not pay for the bundled
model: a few layers of width 96 over the tokenizer's 49k vocabulary, ~5 M parameters.

9 query heads over 3 KV heads, like SmolLM2-135M, so tensor parallelism at 2 splits unevenly."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
             "intermediate_size": 160, "num_attention_heads": 9, "num_key_value_heads": 3,
             "head_dim": 16, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "max_position_embeddings": 2048, "tie_word_embeddings": True}


@functools.cache
def _tokenizer_json() -> str:
    from real.model.tokenizer import Tokenizer
    from real.model.weights import bundled_gguf_path, open_gguf

    return Tokenizer.from_gguf(open_gguf(bundled_gguf_path())).backend.to_str()


def write_tiny_checkpoint(path: Path, *, seed: int, layers: int = 2, base: Path | None = None,
                          noise: float = 0.0) -> Path:
    """A checkpoint directory at ``path``: random weights from ``seed``, or ``base``'s weights
    plus relative Gaussian ``noise`` (a draft that agrees with its target often, not always)."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {**HF_CONFIG, "num_hidden_layers": layers}
    gen = torch.Generator().manual_seed(seed)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hq * hd, d), p + "self_attn.k_proj.weight": (hkv * hd, d),
                   p + "self_attn.v_proj.weight": (hkv * hd, d), p + "self_attn.o_proj.weight": (d, hq * hd),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    if base is not None:
        state = load_file(str(base / "model.safetensors"))
        state = {k: t + noise * t.std() * torch.randn(t.shape, generator=gen) if t.dim() > 1 else t
                 for k, t in state.items()}
    else:
        state = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.08
                 for k, s in shapes.items()}
    save_file({k: t.contiguous() for k, t in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text(_tokenizer_json())
    return path
