"""Our Transformer against an independent implementation: transformers' LlamaForCausalLM.

Bundled SmolLM2 (marked `model`): both load the same GGUF with their own reader, dequantizer
and Q/K un-permutation. Tiny random HF checkpoints (saved to a temp dir, sharded) test the
directory loader, GQA, untied/tied heads and Llama 3 RoPE scaling without any download.
"""

from __future__ import annotations

import pytest
import torch

from real.model.generate import greedy_generate
from real.model.weights import build_model, load_checkpoint_dir
from tests.helpers.real_models import bundled, hf_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "def fib(n):\n    # complete this Python function"}],
]
GREEDY_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works.",
]


@pytest.mark.model
@torch.inference_mode()
def test_logits_match_hf_on_the_bundled_gguf() -> None:
    model, tok = bundled()
    hf = hf_model()
    texts = [tok.apply_chat_template(m, tokenize=True) for m in PROMPTS]
    texts.append(tok.encode("The quick brown fox jumps over the lazy dog. 1234 + 5678 = "))
    worst = 0.0
    for ids in texts:
        x = torch.tensor([ids])
        ours, ref = model(x, 0), hf(x).logits
        assert ours.shape == ref.shape
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.equal(ours[0, -1].topk(5).indices, ref[0, -1].topk(5).indices)
    print(f"max |logit diff| vs HF over {len(texts)} prompts: {worst:.2e}")
    assert worst < 1e-3  # logits reach ~40; measured ~1e-4 (fp32 summation order)


@pytest.mark.model
@pytest.mark.slow  # 12 s; the logits test above holds the same model to HF by default
def test_greedy_64_tokens_match_hf_generate() -> None:
    model, tok = bundled()
    hf = hf_model()
    for prompt in GREEDY_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
        ours = greedy_generate(model, ids, 64, tok.eos_token_ids)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):]
        assert ours == ref.tolist()
        assert len(ours) == 64  # these prompts run past 64 tokens: the whole window is compared


@pytest.mark.model
@torch.inference_mode()
def test_early_exit_matches_hf_intermediate_hidden_state() -> None:
    model, tok = bundled()
    hf = hf_model()
    x = torch.tensor([tok.encode("Speculative decoding drafts tokens with a cheap model")])
    hidden = hf(x, output_hidden_states=True).hidden_states
    for k in (4, 12):
        ref = hf.lm_head(hf.model.norm(hidden[k]))
        torch.testing.assert_close(model.early_exit(x, k, 0), ref, atol=1e-3, rtol=0)


def _tiny_hf_checkpoint(tmp_path, tied: bool, llama3_rope: bool):
    transformers = pytest.importorskip("transformers", reason="dev dependency: the reference model")
    rope = {"rope_type": "default", "rope_theta": 500.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=101, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, rope_parameters=rope)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF inits norms to 1: perturb them so a missed norm weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + index
    return hf


@pytest.mark.parametrize("tied,llama3_rope", [(False, True), (True, False)])
@torch.inference_mode()
def test_checkpoint_dir_matches_hf(tmp_path, tied: bool, llama3_rope: bool) -> None:
    hf = _tiny_hf_checkpoint(tmp_path, tied, llama3_rope)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    args, state = load_checkpoint_dir(tmp_path)
    assert args.tie_embeddings == tied and args.n_kv_heads == 2
    assert (args.rope_scaling or {}).get("rope_type") == ("llama3" if llama3_rope else None)
    model = build_model(args, state, max_seq=128)
    x = torch.randint(0, 101, (1, 80), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x, 0), hf(x).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_bf16_model_runs_and_stays_close_to_fp32(tmp_path) -> None:
    _tiny_hf_checkpoint(tmp_path, tied=False, llama3_rope=False)
    args, state = load_checkpoint_dir(tmp_path)
    fp32 = build_model(args, state, max_seq=64)
    bf16 = build_model(args, state, dtype=torch.bfloat16, max_seq=64)
    x = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(2))
    a, b = fp32(x, 0), bf16(x, 0)
    assert b.dtype == torch.float32 and bf16.layers[0].attention.kv_cache.k_cache.dtype == torch.bfloat16
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
