"""Everything a real run needs before its first forward: the models (loaded once per process,
so a sweep loads each once), the draft of the pair, the vocabulary check between them, and the
requests (the workload's prompts rendered and tokenized, checked against the context)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from real.errors import RealSetupError, WeightsNotFound
from real.model.batch_graphs import GraphedBatches
from real.model.cuda_graphs import MAX_TOKENS, GraphedForwards
from real.model.decoder import Transformer
from real.model.drafts import Draft, EarlyExitDraft, ModelDraft, NgramDraft
from real.model.eagle import EagleDraft, load_head
from real.model.tokenizer import Tokenizer
from real.runtime.context import RealRequest
from testbed.config import ExperimentConfig, real_dtype
from testbed.paths import repo_path
from testbed.registry import Registry
from testbed.schedules import spec_of
from testbed.spec.sampling import SamplingParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUNDLED_TARGET = "smollm2_135m"
_MODELS: dict[tuple, tuple[Transformer, Tokenizer]] = {}  # loaded once per process (sweeps)


def model_device(exp: ExperimentConfig) -> torch.device:
    """Where this process runs its models: the host, or its GPU (a worker's ``place`` made it
    the current one; ``real.device=cuda:N`` names one outright)."""
    name = exp.real.device
    if not name.startswith("cuda"):
        return torch.device("cpu")
    return torch.device(name) if ":" in name else torch.device("cuda", torch.cuda.current_device())


def load(path: str | None, what: str, *, model_name: str, dtype: str,
         device: torch.device | str = "cpu", cuda_graphs: bool = False) -> tuple[Transformer, Tokenizer]:
    from real.model.weights import load_model

    if path is None and model_name != BUNDLED_TARGET:
        raise RealSetupError(
            f"{what}.path is not set for {model_name!r}: backend=real needs local weights "
            f"(set {what}.path=DIR_OR_GGUF, or use the bundled pair=smollm2_135m+smollm2_draft)")
    resolved = None if path is None else repo_path(path)
    if resolved is not None and not resolved.exists():
        raise WeightsNotFound(str(path), f"set {what}.path to an existing .gguf file or checkpoint "
                              "directory (config.json, *.safetensors, tokenizer.json)")
    key = (str(resolved), dtype, str(device))
    if key not in _MODELS:
        _MODELS[key] = load_model(resolved, dtype=DTYPES[dtype], device=device, max_seq=64)
    attach_graphs(_MODELS[key][0], cuda_graphs)  # set per run: the model is shared
    return _MODELS[key]


def attach_graphs(model: Transformer, cuda_graphs: bool) -> None:
    """Let ``model``'s forwards replay CUDA graphs where ``cuda_graphs`` is on and it lives on a
    GPU: one request's chains and trees (real.model.cuda_graphs) and batched chains
    (real.model.batch_graphs). Runs and calibration alike, so that the profile times what the
    runs replay."""
    model.graph_forwards = GraphedForwards(model) if cuda_graphs and model.device.type == "cuda" else None
    model.graph_batches = GraphedBatches(model) if model.graph_forwards is not None else None


def prepare_graphs(exp: ExperimentConfig, *models: Transformer | None) -> None:
    """Capture the CUDA graphs a run's forwards will replay before its timed requests: chain
    windows of 1..γ+1 tokens (a verification, a draft catching up), and tree-masked forwards of
    up to 16 nodes for token trees. Nothing where graphs are off (CPU, stages, TP ranks)."""
    tree = bool(exp.schedule.tree or spec_of(exp).tree)
    counts = range(1, min(MAX_TOKENS, max(1, exp.schedule.gamma) + 1) + 1)
    for model in models:
        if model is not None and model.graph_forwards is not None:
            model.graph_forwards.prepare(counts, tree=False)
            if tree:
                model.graph_forwards.prepare(range(1, MAX_TOKENS + 1), tree=True)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The tokenizer of a checkpoint without its weights (decoding a run's outputs in the
    launcher of a multi-process run); the loaded model's when this process has one."""
    from real.model.tokenizer import load_bundled_tokenizer

    resolved = None if path is None else repo_path(path)
    for (loaded, _, _), (_, tokenizer) in _MODELS.items():
        if loaded == str(resolved):
            return tokenizer
    if resolved is None:
        return load_bundled_tokenizer()
    return Tokenizer.from_dir(resolved) if resolved.is_dir() else Tokenizer.from_gguf(resolved)


def check_vocab(target_tok: Tokenizer, target: Transformer, *, draft_tok: Tokenizer, draft: Transformer,
                draft_name: str) -> None:
    if draft.args.vocab_size != target.args.vocab_size or draft_tok.vocab_size != target_tok.vocab_size \
            or any(draft_tok.backend.id_to_token(i) != target_tok.backend.id_to_token(i)
                   for i in range(0, target_tok.vocab_size, 97)):
        raise RealSetupError(
            f"pair.draft={draft_name!r} has a vocabulary of {draft.args.vocab_size} tokens "
            f"(tokenizer {draft_tok.vocab_size}) that differs from the target's "
            f"{target.args.vocab_size} ({target_tok.vocab_size}): a draft must share the "
            "target's tokenizer; choose a draft trained for this target")


# a draft of each model kind (testbed.config.MODEL_KINDS): kind -> factory(exp, target, tokenizer, params)
DraftFactory = Callable[[ExperimentConfig, Transformer, Tokenizer, SamplingParams], Draft]
DRAFTS: Registry[DraftFactory] = Registry("pair.draft.kind")


@DRAFTS.register("ngram")
def _ngram_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
                 params: SamplingParams) -> Draft:
    return NgramDraft(exp.pair.draft.ngram, target.args.vocab_size)


@DRAFTS.register("early_exit")
def _early_exit_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
                      params: SamplingParams) -> Draft:
    d = exp.pair.draft
    if not 1 <= d.exit_layer < target.args.n_layers:
        raise RealSetupError(f"pair.draft.exit_layer={d.exit_layer} must be in [1, "
                             f"{target.args.n_layers - 1}] for this target")
    return EarlyExitDraft(target, d.exit_layer, params)


@DRAFTS.register("eagle")
def _eagle_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
                 params: SamplingParams) -> Draft:
    d = exp.pair.draft
    if d.path is None:
        raise RealSetupError(f"pair.draft.path is not set for the eagle head {d.name!r}: point it at a "
                             "directory written by python -m real.train.draft kind=eagle")
    path = repo_path(d.path)
    if not path.is_dir():
        raise WeightsNotFound(str(d.path), "set pair.draft.path to an eagle head directory "
                              "(python -m real.train.draft kind=eagle writes one)")
    return EagleDraft(load_head(path, target, draft_vocab=d.draft_vocab), target, params, d.name)


@DRAFTS.register("transformer")
def _model_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
                 params: SamplingParams) -> Draft:
    d = exp.pair.draft
    model, tok = load(d.path, "pair.draft", model_name=d.name, dtype=real_dtype(exp), device=model_device(exp),
                      cuda_graphs=exp.real.cuda_graphs)
    check_vocab(tokenizer, target, draft_tok=tok, draft=model, draft_name=d.name)
    return ModelDraft(model, params, d.name)


def make_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
               params: SamplingParams) -> Draft | None:
    """The pair's draft (None for a schedule without one: `ar`)."""
    if not spec_of(exp).drafts:
        return None
    return DRAFTS.get(exp.pair.draft.kind)(exp, target, tokenizer, params)


def build_requests(exp: ExperimentConfig, tokenizer: Tokenizer, max_context: int) -> list[RealRequest]:
    from testbed.workloads import choose_prompts, render

    w = exp.workload
    if w.name == "synthetic":
        raise RealSetupError("workload=synthetic has no text: backend=real needs "
                             "workload=humaneval|mtbench|alpaca")
    out = []
    for i, p in enumerate(choose_prompts(exp)):
        rendered = render(p, tokenizer, w.chat_template)
        ids = rendered if isinstance(rendered, list) else tokenizer.encode(rendered)
        need = len(ids) + w.max_new_tokens + exp.schedule.gamma + 1
        if need > max_context:
            raise RealSetupError(
                f"prompt {p.id} has {len(ids)} tokens; with workload.max_new_tokens={w.max_new_tokens} "
                f"and schedule.gamma={exp.schedule.gamma} it needs {need} positions but the target's "
                f"context is {max_context}: lower workload.max_new_tokens or choose shorter prompts")
        out.append(RealRequest(i, p.id, ids, w.max_new_tokens))
    if w.arrival == "trace":  # one request per row: the prompts cycled, the row's output length
        from testbed.arrivals import read_trace

        rows = read_trace(w.trace_path)
        out = [RealRequest(i, out[i % len(out)].prompt_id, out[i % len(out)].prompt_ids, row.output_tokens)
               for i, row in enumerate(rows)]
        for r in out:
            if r.prompt_len + r.max_new_tokens + exp.schedule.gamma + 1 > max_context:
                raise RealSetupError(f"trace row {r.request_id + 1}: prompt {r.prompt_id} ({r.prompt_len} tokens) "
                                     f"+ output_tokens {r.max_new_tokens} exceed the target's context "
                                     f"({max_context}): shorten the trace's output_tokens")
    return out
