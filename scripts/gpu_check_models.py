"""The GPU check's models and forward timings (``scripts/gpu_check.py``).

Checkpoints: random-weight Llama-family models written as an HF directory (safetensors,
config.json, the SmolLM2 tokenizer files shipped in ``models/smollm2-draft``), so the check
needs no model hub and no GGUF. Purely random weights would make every draft guess wrong
(α ≈ 0) and hide the speculative regime, so both models are built around one hidden "language":
a random permutation ``g`` of the vocabulary. The LM head's row ``g(x)`` is token ``x``'s
embedding, so a model whose residual stream still points at its input's embedding predicts
``g(x)``; the random layers add context-dependent perturbations of relative size ``mix``, which
sometimes move the argmax elsewhere. Target and draft share ``g`` but not their layers, so the
draft agrees with the target often, not always (α is reported, not assumed).

Forward timing: a k-token forward (k = 1..16) at a fixed context, eager and, on CUDA, replayed
from a CUDA graph (gpt-fast's way of removing launch overhead), against the roofline
max(bytes / measured bandwidth, FLOPs / measured GEMM peak).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "smollm2-draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
VOCAB = 49152  # the SmolLM2 tokenizer's


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = 64

    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.ffn + 2 * self.hidden) + 2 * VOCAB * self.hidden + self.hidden

    def preset(self, quant: str = "fp32") -> dict:
        """The testbed's model preset fields (``pair.target.*`` overrides); ``quant``: the dtype
        the runs use (what the roofline charges)."""
        return {"name": self.name, "layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn, "vocab": VOCAB,
                "tied_embeddings": False, "max_context": 4096, "rope_theta": 500000.0, "quant": quant,
                "tokenizer": "smollm2"}


# Llama-3.2-1B's layer shapes (16 x 2048, 32/8 heads, FFN 8192) over the 49k vocabulary: 1.0 B
# parameters; the draft ~57 M (8 x 512).
TARGET_1B = Shape("gpucheck_1b", 16, 2048, 32, 8, 8192)
DRAFT_60M = Shape("gpucheck_60m", 8, 512, 8, 4, 2048)
# the dry run's (a CPU in seconds)
TARGET_TINY = Shape("gpucheck_tiny_target", 4, 256, 4, 2, 512)
DRAFT_TINY = Shape("gpucheck_tiny_draft", 2, 128, 2, 1, 256)


def _hf_config(s: Shape) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "intermediate_size": s.ffn,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def write_checkpoint(path: Path, s: Shape, *, mix: float, seed: int, device: str = "cpu") -> Path:
    """An HF checkpoint directory at ``path`` (bf16): the permutation "language" of the module
    docstring with layer perturbations of relative size ``mix``; ``seed`` picks the layers,
    the permutation is the same for every model (seed 0)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))  # g: x -> perm[x]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    d, hd = s.hidden, s.head_dim
    emb = randn(VOCAB, d, std=1.0)
    head = torch.empty_like(emb)
    head[perm] = emb  # row g(x) = embedding of x: argmax of an unperturbed stream is g(x)
    # each layer's two outputs add ~mix/sqrt(layers) of the stream's size: the sum over the
    # layers ~mix (inputs to o_proj and down_proj have components of order 1 and 0.5)
    # ``mix`` is in units of the flip threshold: a perturbation of relative size r moves the
    # argmax off g(x) once r * sqrt(2 ln V / d) (its largest projection on another token's row)
    # nears 1
    per_layer = mix * (d / (2 * math.log(VOCAB))) ** 0.5 / s.layers ** 0.5
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": head,
             "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": randn(s.heads * hd, d, std=d ** -0.5),
                  p + "self_attn.k_proj.weight": randn(s.kv_heads * hd, d, std=d ** -0.5),
                  p + "self_attn.v_proj.weight": randn(s.kv_heads * hd, d, std=d ** -0.5),
                  p + "self_attn.o_proj.weight": randn(d, s.heads * hd, std=per_layer / (s.heads * hd) ** 0.5),
                  p + "mlp.gate_proj.weight": randn(s.ffn, d, std=d ** -0.5),
                  p + "mlp.up_proj.weight": randn(s.ffn, d, std=d ** -0.5),
                  p + "mlp.down_proj.weight": randn(d, s.ffn, std=2 * per_layer / s.ffn ** 0.5),
                  p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16)}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(_hf_config(s), indent=1))
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, path / name)
    return path


# ------------------------------------------------------------------------------ machine
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, *, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_peaks(device: torch.device, *, tiny: bool) -> dict:
    """Read bandwidth (a copy: bytes read + written) and the bf16 GEMM peak, measured here."""
    n = (1 << 22) if tiny else (1 << 30)  # bytes per copy buffer
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), device, repeats=5)
    m = 512 if tiny else 8192
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    b = torch.randn(m, m, device=device).to(torch.bfloat16)
    gemm_s = _median_s(lambda: a @ b, device, repeats=5)
    return {"bandwidth_GBps": float(f"{2 * n / copy_s / 1e9:.4g}"),
            "bf16_tflops": float(f"{2 * m ** 3 / gemm_s / 1e12:.4g}")}


def forward_times(model, *, context: int, ks: list[int], peaks: dict, repeats: int) -> list[dict]:
    """Per k: eager and (CUDA) graph-replayed time of a k-token forward at slot ``context``,
    with its roofline; the KV cache holds ``context`` slots."""
    import specbed_kernels as kernels

    device = model.device
    bytes_w = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    args = model.args
    kv_row = 2 * args.n_layers * args.n_kv_heads * args.head_dim * 2  # bf16 K and V per slot
    model.setup_cache(context + max(ks) + 1)
    with torch.inference_mode():
        model.forward_layers(model.embed(torch.zeros(1, context, dtype=torch.long, device=device)), 0)

        def logits_on_device(x: torch.Tensor) -> torch.Tensor:  # no host copy: capturable
            h = model.forward_layers(model.embed(x), context)
            return kernels.linear(kernels.rms_norm(h, model.norm, args.norm_eps), model.output)

        rows = []
        for k in ks:
            x = torch.ones(1, k, dtype=torch.long, device=device)
            eager = _median_s(lambda x=x: logits_on_device(x), device, repeats=repeats)
            flops = 2 * n_params * k
            roof = max((bytes_w + kv_row * (context + k)) / (peaks["bandwidth_GBps"] * 1e9),
                       flops / (peaks["bf16_tflops"] * 1e12))
            row = {"k": k, "eager_ms": round(eager * 1e3, 4), "roofline_ms": round(roof * 1e3, 4),
                   "eager_share": round(roof / eager, 3)}
            if device.type == "cuda":
                row |= _graph_time(logits_on_device, x, device=device, repeats=repeats, roof=roof)
            rows.append(row)
    return rows


def _graph_time(fn, x: torch.Tensor, *, device: torch.device, repeats: int, roof: float) -> dict:
    """The same forward captured once into a CUDA graph and replayed (static inputs, the same
    slots: a replay rewrites the same K/V slots, as a verification window does)."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(x)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
        t = _median_s(graph.replay, device, repeats=repeats)
        del graph
        return {"graph_ms": round(t * 1e3, 4), "graph_share": round(roof / t, 3)}
    except Exception as e:  # noqa: BLE001 - reported in the summary, the eager row stands
        return {"graph_error": f"{type(e).__name__}: {e}"[:200]}
