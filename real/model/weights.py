"""Loading Llama-family weights from local files only: a GGUF file or an HF checkpoint directory.

Both paths first produce HF-named fp32 tensors (``model.layers.0.self_attn.q_proj.weight``, ...)
and then ``to_model_state`` fuses them into the ``Transformer``'s layout (Q|K|V and gate|up
concatenated once here, so a decode step runs one GEMM for each).

GGUF specifics handled here: llama.cpp's tensor names; its Q/K row permutation (llama.cpp's
converter interleaves the two halves of each head for its RoPE; we undo it to get the
rotate-half layout of HF); quantized blocks dequantized with ``gguf.quants``; tied LM head (no
``output.weight``); numpy shapes already ``[out, in]`` (GGUF lists dims in the reverse order).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from real.errors import INSTALL_BUNDLED, UnsupportedCheckpoint, WeightsNotFound
from real.model.decoder import ModelArgs, Transformer
from real.model.paths import BUNDLED_FILE, BUNDLED_PACKAGE, bundled_gguf_path, open_gguf  # noqa: F401 (re-exported)
from real.model.tokenizer import Tokenizer

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


# ---------------------------------------------------------------------------------------- GGUF
def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows (pair, half) -> (half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_args(reader) -> ModelArgs:  # reader: gguf.GGUFReader
    """Architecture from GGUF metadata (only ``general.architecture == "llama"``)."""
    def get(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise UnsupportedCheckpoint(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedCheckpoint("GGUF with rope_freqs (Llama 3.1 long-context RoPE) is not "
                                    "supported; load the HF checkpoint directory instead")
    n_heads = get(f"{arch}.attention.head_count")
    dim = get(f"{arch}.embedding_length")
    vocab = get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelArgs(
        dim=dim, n_layers=get(f"{arch}.block_count"), n_heads=n_heads,
        n_kv_heads=get(f"{arch}.attention.head_count_kv", n_heads),
        ffn_dim=get(f"{arch}.feed_forward_length"), vocab_size=vocab,
        head_dim=get(f"{arch}.attention.key_length", dim // n_heads),
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=get(f"{arch}.context_length", 2048),
        tie_embeddings="output.weight" not in names,
    )


def gguf_hf_state(reader, args: ModelArgs) -> dict[str, Tensor]:
    """All tensors of a GGUF, dequantized to fp32, with HF Llama names and row order."""
    from gguf.quants import dequantize

    out: dict[str, Tensor] = {}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            if kind not in _GGUF_LAYER_NAMES:
                raise UnsupportedCheckpoint(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
        elif base in _GGUF_GLOBAL_NAMES:
            kind, name = base, f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
        else:
            raise UnsupportedCheckpoint(f"unexpected GGUF tensor {t.name!r}")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        expected = tuple(int(d) for d in reversed(t.shape))
        w = w.reshape(expected)
        if kind == "attn_q":
            w = _unpermute_rows(w, args.n_heads)
        elif kind == "attn_k":
            w = _unpermute_rows(w, args.n_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors are views of the mmap
            w = np.array(w, copy=True)
        out[name] = torch.from_numpy(w)
    return out


def load_gguf(source) -> tuple[ModelArgs, dict[str, Tensor]]:
    """A llama GGUF (path or open ``GGUFReader``) -> (architecture, fp32 state dict in the
    ``Transformer``'s layout)."""
    reader = source if hasattr(source, "tensors") else open_gguf(source)
    args = gguf_args(reader)
    return args, to_model_state(gguf_hf_state(reader, args), args)


# ----------------------------------------------------------------------------- HF directory
def hf_args(config: dict) -> ModelArgs:
    """Architecture from an HF ``config.json`` (Llama family: llama, mistral)."""
    kind = config.get("model_type")
    if kind not in ("llama", "mistral"):
        raise UnsupportedCheckpoint(f"model_type {kind!r} is not supported (llama, mistral)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UnsupportedCheckpoint("checkpoints with attention/MLP biases are not supported")
    rope = dict(config.get("rope_parameters") or {})  # transformers >= 5 keeps theta in here
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    n_heads = config["num_attention_heads"]
    return ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        ffn_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling, max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    return sorted(path.glob("*.safetensors"))


def load_checkpoint_dir(path: str | Path) -> tuple[ModelArgs, dict[str, Tensor]]:
    """A local HF Llama-family directory (config.json + safetensors, sharded or not) ->
    (architecture, fp32 state dict in the ``Transformer``'s layout)."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise WeightsNotFound(str(config_file), "point model.path at a checkpoint directory with "
                              "config.json and *.safetensors (or at a .gguf file)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedCheckpoint(f"{config_file}: not readable JSON ({e})") from None
    args = hf_args(config)
    files = _safetensors_files(path)
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise WeightsNotFound(str(missing[0] if missing else path / "*.safetensors"),
                              "the directory needs its *.safetensors weights (convert .bin "
                              "checkpoints with transformers' save_pretrained)")
    hf: dict[str, Tensor] = {}
    for f in files:
        try:
            hf.update({k: v.float() for k, v in load_file(str(f)).items()})
        except Exception as e:  # safetensors raises its own error kinds for damaged files
            raise UnsupportedCheckpoint(f"{f}: not a readable safetensors file ({e})") from None
    return args, to_model_state(hf, args)


# ------------------------------------------------------------------------------------ fusing
def to_model_state(hf: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """HF Llama names -> the ``Transformer``'s fused state dict (Q|K|V rows, gate|up rows).

    Sets ``args.tie_embeddings`` when the checkpoint has no separate LM head."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    try:
        out = {"tok_embeddings.weight": hf["embed_tokens.weight"], "norm": hf["norm.weight"]}
        for i in range(args.n_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            out[p + "attention_norm"] = hf[p + "input_layernorm.weight"]
            out[p + "ffn_norm"] = hf[p + "post_attention_layernorm.weight"]
            out[p + "attention.wqkv"] = torch.cat(
                [hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])
            out[p + "attention.wo"] = hf[a + "o_proj.weight"]
            out[p + "feed_forward.w13"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
            out[p + "feed_forward.w2"] = hf[m + "down_proj.weight"]
    except KeyError as e:
        raise UnsupportedCheckpoint(f"checkpoint lacks tensor {e.args[0]!r} (not a Llama-family "
                                    "decoder, or fewer layers than its config says)") from None
    if "lm_head.weight" not in hf:
        args.tie_embeddings = True
    out["output"] = out["tok_embeddings.weight"] if args.tie_embeddings else hf["lm_head.weight"]
    return out


# --------------------------------------------------------------------------------- top level
def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", max_seq: int = 2048) -> tuple[Transformer, Tokenizer]:
    """Model + tokenizer from a .gguf file, an HF checkpoint directory, or (None) the bundled
    SmolLM2-135M-Instruct GGUF. KV caches are allocated for ``max_seq`` slots."""
    path = bundled_gguf_path() if path is None else Path(path).expanduser()
    if path.is_dir():
        args, state = load_checkpoint_dir(path)
        tokenizer = Tokenizer.from_dir(path)
    elif path.suffix == ".gguf" or path.is_file():
        from real.model import gguf_cache

        cached = gguf_cache.load(path) if path.is_file() else None
        if cached is not None:
            args, state = cached
            tokenizer = Tokenizer.from_gguf(path)  # through its own cache
        else:
            reader = open_gguf(path)
            args, state = load_gguf(reader)
            gguf_cache.store(path, args, state)
            tokenizer = Tokenizer.from_gguf(path, reader=reader)  # into its cache too
    else:
        raise WeightsNotFound(str(path), "pass a .gguf file or an HF checkpoint directory, or no "
                              f"path for the bundled SmolLM2 ({INSTALL_BUNDLED})")
    return build_model(args, state, dtype=dtype, device=device, max_seq=max_seq), tokenizer


def build_model(args: ModelArgs, state: dict[str, Tensor], *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", max_seq: int = 2048) -> Transformer:
    """A ``Transformer`` holding ``state`` (from ``load_gguf``/``load_checkpoint_dir``) in
    ``dtype`` on ``device``, with KV caches for ``max_seq`` slots."""
    model = Transformer(args, dtype=dtype, device=device)  # uninitialized, filled just below
    model.load_state_dict(state)  # copies, converting to dtype
    model.setup_cache(max_seq)
    return model.eval()
