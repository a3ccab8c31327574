"""Train a small draft for the bundled SmolLM2-135M-Instruct target by distillation (issue 5).

    python -m real.train.draft                        # default: conf/train_draft.yaml
    python -m real.train.draft steps=50 out=/tmp/d threads=1
    python -m real.train.draft kind=eagle             # a feature-level head instead (real/train/eagle.py)

Two phases, both resumable (rerun the same command after an interruption):

1. Teacher data (real/train/draft_data.py; cached under ``work_dir/data``, one file per batch, reused): the
   target's greedy and sampled (T=1) continuations of calibration prompts (``calibrate`` split
   of humaneval, mtbench and alpaca; the ``holdout`` split is never read) and of function
   headers+docstrings cut from the Python standard library, plus teacher-forced chunks of
   stdlib source. Every position stores the target's top-k log-probabilities.
2. Distillation of a tiny Llama -- ``real.model.decoder.Transformer`` itself, on the reference ops and
   without a KV cache (tied embeddings initialised by a PCA of the target's) -- with the
   KL to the target's top-k distribution (the tail mass as one extra bucket). A checkpoint
   (model, optimizer, RNG, step = data position) is written every few minutes; the data order
   is a pure function of (seed, step), so a resumed run reproduces an uninterrupted one.

The result is exported as a plain HF LlamaForCausalLM directory (``out``) that both
``real.model.weights.load_model`` and transformers' ``AutoModelForCausalLM`` load.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from real.errors import USER_ERRORS, RealSetupError
from real.model.decoder import ModelArgs, Transformer
from real.model.weights import to_model_state
from real.train.draft_data import (  # noqa: E402  (phase 1: the teacher data)
    _atomic_save,
    batch_at,
    build_teacher_data,
    pack,
)
from real.train.eagle import train as train_eagle
from specbed_kernels import reference_kernels
from testbed.paths import ROOT, repo_path


# ------------------------------------------------------------------------------ the draft
def draft_args(arch: dict) -> ModelArgs:
    """The draft's architecture (``arch`` of conf/train_draft.yaml): a Llama with tied embeddings."""
    return ModelArgs(**arch, tie_embeddings=True)


def init_draft(args: ModelArgs, target_embedding: Tensor | None, seed: int) -> Transformer:
    """A trainable ``real.model.decoder.Transformer`` (fp32, gradients on, no KV cache): small random
    matrices, norms 1; the embedding (= LM head) is the target's projected on its top-``dim``
    principal directions, so the draft starts with the target's token geometry."""
    gen = torch.Generator().manual_seed(seed)
    hd, ffn = args.head_dim, args.ffn_dim
    # HF-named tensors, fused by the loader's own to_model_state (one layout, one fusing rule)
    hf = {"model.embed_tokens.weight": torch.randn(args.vocab_size, args.dim, generator=gen) * 0.02,
          "model.norm.weight": torch.ones(args.dim)}
    out_scale = 1.0 / math.sqrt(2 * args.n_layers)  # residual-branch outputs (GPT-2 style)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (args.n_heads * hd, args.dim),
                  "self_attn.k_proj": (args.n_kv_heads * hd, args.dim),
                  "self_attn.v_proj": (args.n_kv_heads * hd, args.dim),
                  "self_attn.o_proj": (args.dim, args.n_heads * hd),
                  "mlp.gate_proj": (ffn, args.dim), "mlp.up_proj": (ffn, args.dim),
                  "mlp.down_proj": (args.dim, ffn)}
        for name, shape in shapes.items():
            w = torch.randn(shape, generator=gen) * 0.02
            hf[p + name + ".weight"] = w * out_scale if name.endswith(("o_proj", "down_proj")) else w
        hf[p + "input_layernorm.weight"] = torch.ones(args.dim)
        hf[p + "post_attention_layernorm.weight"] = torch.ones(args.dim)
    if target_embedding is not None:
        e = target_embedding.double()
        e = e - e.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(e[:: max(1, e.shape[0] // 16384)], full_matrices=False)
        proj = e @ v[: args.dim].T  # [V, dim]
        # unit-norm rows: logits start at a few units (not hundreds) after the final RMSNorm
        hf["model.embed_tokens.weight"] = (proj / proj.std()).float() / math.sqrt(args.dim)
    model = Transformer(args)  # parameters uninitialized until the load just below
    model.load_state_dict(to_model_state(hf, args))
    return model.requires_grad_(True)


def hf_state(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under HF Llama names (tied: no lm_head.weight): the inverse of
    ``real.model.weights.to_model_state``, splitting Q|K|V and gate|up again."""
    a = model.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.attention.wqkv.split([q, kv, kv])
        gate, up = layer.feed_forward.w13.split([a.ffn_dim, a.ffn_dim])
        out |= {p + "input_layernorm.weight": layer.attention_norm,
                p + "post_attention_layernorm.weight": layer.ffn_norm,
                p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer.attention.wo,
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.feed_forward.w2}
    return {k: v.detach() for k, v in out.items()}


def draft_logits(model: Transformer, tokens: Tensor, select: Tensor | None = None) -> Tensor:
    """Training forward, cache-free: logits ``[B, T, V]``, or ``[N, V]`` for the positions where
    ``select [B, T]`` is true (the LM head dominates the cost: skip positions without a loss)."""
    h = model.forward_layers(model.embed(tokens), cache=False)
    return model.head(h if select is None else h[select])


def distill_loss(logits: Tensor, idx: Tensor, lp: Tensor, w: Tensor) -> Tensor:
    """Weighted KL(p || q) up to p's entropy, with p = the teacher's top-k probabilities plus
    one bucket holding the rest of its mass (q's mass outside the top-k)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    lq = logq.gather(-1, idx)
    p = lp.exp()
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_tail = (1.0 - lq.exp().sum(-1)).clamp_min(1e-6)
    ce = -(p * lq).sum(-1) - p_tail * q_tail.log()
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def lr_at(step: int, cfg: DictConfig) -> float:
    t = cfg.train
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    frac = (step - t.warmup) / max(1, cfg.steps - t.warmup)
    return t.lr * (t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# --------------------------------------------------------------------------------- export
def export_hf(model: Transformer, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """A plain HF LlamaForCausalLM directory with the target's tokenizer (from the GGUF)."""
    from safetensors.torch import save_file

    from real.model.tokenizer import load_bundled_tokenizer

    a = model.args
    out.mkdir(parents=True, exist_ok=True)
    tok = load_bundled_tokenizer()
    state = {k: v.to(dtype).contiguous() for k, v in hf_state(model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    bos, eos = tok.bos_token_id, tok.eos_token_ids[0]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "intermediate_size": a.ffn_dim,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
        "rope_scaling": None, "use_cache": True, "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": eos, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n")
    tok.backend.save(str(out / "tokenizer.json"))
    name = tok.backend.id_to_token
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(bos),
        "eos_token": name(eos), "pad_token": name(eos), "unk_token": name(0),
        "add_bos_token": False, "model_max_length": 8192, "clean_up_tokenization_spaces": False,
        "chat_template": tok.chat_template}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": name(bos), "eos_token": name(eos), "pad_token": name(eos),
         "unk_token": name(0)}, indent=2) + "\n")


# ---------------------------------------------------------------------------------- train
def arch_from_cfg(cfg: DictConfig) -> ModelArgs:
    return draft_args(OmegaConf.to_container(cfg.arch, resolve=True))  # type: ignore[arg-type]


def target_embedding() -> Tensor:
    from real.model.weights import bundled_gguf_path, gguf_hf_state, open_gguf

    reader = open_gguf(bundled_gguf_path())
    from real.model.weights import gguf_args

    return gguf_hf_state(reader, gguf_args(reader))["model.embed_tokens.weight"]


def train_step(model: Transformer, opt: torch.optim.Optimizer, *, batch: tuple[Tensor, ...],
               lr: float, cfg: DictConfig) -> float:
    """One optimizer step on ``batch`` (tokens, teacher ids, log-probs, weights); the loss."""
    toks, idx, lp, w = batch
    for g in opt.param_groups:
        g["lr"] = lr
    sel = w > 0
    with reference_kernels():
        # bf16 matmuls (avx512_bf16: ~3x fp32 here); the loss itself is computed in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(cfg.train.bf16)):
            logits = draft_logits(model, toks, sel)
        loss = distill_loss(logits, idx[sel], lp[sel], w[sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    opt.step()
    return float(loss.detach())


def train(cfg: DictConfig) -> Transformer:
    """Both phases; returns the trained draft (also checkpointed and exported)."""
    from tqdm import tqdm

    torch.set_num_threads(int(cfg.threads))
    work = repo_path(cfg.work_dir)
    data_dir = repo_path(cfg.data_dir) if cfg.get("data_dir") else work / "data"
    ckpt_path = work / "ckpt.pt"
    t_start = time.time()
    paths = build_teacher_data(cfg, data_dir, workers=int(cfg.threads))
    data = pack(paths, cfg)
    t_data = time.time() - t_start
    a, t = arch_from_cfg(cfg), cfg.train
    model = init_draft(a, target_embedding() if cfg.init_from_target else None, cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=t.lr, betas=(0.9, 0.98), eps=1e-8)
    step, elapsed = 0, 0.0
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        if {k: v.shape for k, v in ck["model"].items()} != shapes:  # another arch, or the former DraftLM
            raise RealSetupError(f"{ckpt_path} is not a checkpoint of this draft architecture "
                                 "(arch.*); delete it to train from step 0 (the teacher data is kept)")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
        random.setstate(ck["py_rng"])
        step, elapsed = ck["step"], ck.get("train_s", 0.0)
        print(f"resumed from {ckpt_path} at step {step}")

    def save() -> None:
        _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                      "rng": torch.get_rng_state(), "py_rng": random.getstate(),
                      "train_s": elapsed + time.time() - t_seg,
                      "config": OmegaConf.to_container(cfg, resolve=True)}, ckpt_path)

    stop = cfg.steps if cfg.get("stop_after") is None else min(cfg.steps, int(cfg.stop_after))
    t_seg, last_ckpt = time.time(), time.time()
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", dynamic_ncols=True,
               mininterval=5)
    ema = None
    while step < stop:
        val = train_step(model, opt, batch=batch_at(data, step, rows=t.batch_rows, seq_len=t.seq_len, seed=cfg.seed),
                         lr=lr_at(step, cfg), cfg=cfg)
        step += 1
        ema = val if ema is None else 0.95 * ema + 0.05 * val
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr_at(step - 1, cfg):.2e}")
        if time.time() - last_ckpt > 60 * t.ckpt_minutes:
            save()
            last_ckpt = time.time()
    bar.close()
    save()
    train_s = elapsed + time.time() - t_seg
    if step >= cfg.steps:
        export_hf(model, repo_path(cfg.out))
        info = {"steps": step, "train_s": round(train_s, 1), "data_s_this_run": round(t_data, 1),
                "positions": int((data.w > 0).sum()), "threads": int(cfg.threads),
                "config": OmegaConf.to_container(cfg, resolve=True)}
        (work / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"exported {repo_path(cfg.out)} after {step} steps ({train_s:.0f} s training)")
    return model


def main() -> None:
    import hydra

    @hydra.main(config_path=str(ROOT / "conf"), config_name="train_draft", version_base=None)
    def _run(cfg: DictConfig) -> None:
        try:
            if cfg.kind not in ("small", "eagle"):
                raise RealSetupError(f"kind={cfg.kind!r}: small (the distilled draft model) or eagle "
                                     "(a feature-level head)")
            train_eagle(cfg) if cfg.kind == "eagle" else train(cfg)
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    _run()


if __name__ == "__main__":
    main()
