"""The real backend: load the pair, serve the workload's prompts one after another (batch 1),
time every round on the wall clock and record it exactly as the simulator does.

Schedules mirror sim/schedules: ``ar`` feeds one token per target forward; ``sync`` drafts γ
guesses, verifies them in one target forward over γ+1 tokens and accepts with
testbed.spec.speculative.speculative_step — the same Algorithm 1 the simulator's oracles call.
``speedup`` needs ``ar`` on the same prompts: it runs after the schedule (``real.baseline``)
and is memoised per process, so a sweep measures it once per prompt set and sampling setting.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from real.drafts import Draft, EarlyExitDraft, ModelDraft, NgramDraft, resolve_path
from real.errors import RealSetupError, WeightsNotFound
from real.model import Transformer
from real.runners import TargetRunner
from real.telemetry import Telemetry
from real.tokenizer import Tokenizer
from testbed.config import ExperimentConfig, as_dict
from testbed.recorder import RunRecorder, RunResult
from testbed.spec.lookahead import make_lookahead
from testbed.spec.sampling import SamplingParams, sample
from testbed.spec.speculative import speculative_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUNDLED_TARGET = "smollm2_135m"
_MODELS: dict[tuple, tuple[Transformer, Tokenizer]] = {}  # loaded once per process (sweeps)
_BASELINES: dict[str, RunRecorder] = {}


@dataclass(frozen=True)
class RealRequest:
    request_id: int
    prompt_id: str
    prompt_ids: list[int]
    max_new_tokens: int


# ------------------------------------------------------------------------------------ loading
def load(path: str | None, what: str, model_name: str, dtype: str) -> tuple[Transformer, Tokenizer]:
    from real.weights import load_model

    if path is None and model_name != BUNDLED_TARGET:
        raise RealSetupError(
            f"{what}.path is not set for {model_name!r}: backend=real needs local weights "
            f"(set {what}.path=DIR_OR_GGUF, or use the bundled pair=smollm2_135m+smollm2_draft)")
    resolved = None if path is None else resolve_path(path)
    if resolved is not None and not resolved.exists():
        raise WeightsNotFound(str(path), f"set {what}.path to an existing .gguf file or checkpoint "
                              "directory (config.json, *.safetensors, tokenizer.json)")
    key = (str(resolved), dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(resolved, dtype=DTYPES[dtype], max_seq=64)
    return _MODELS[key]


def check_vocab(target_tok: Tokenizer, target: Transformer, draft_tok: Tokenizer, draft: Transformer,
                draft_name: str) -> None:
    if draft.args.vocab_size != target.args.vocab_size or draft_tok.vocab_size != target_tok.vocab_size \
            or any(draft_tok.backend.id_to_token(i) != target_tok.backend.id_to_token(i)
                   for i in range(0, target_tok.vocab_size, 97)):
        raise RealSetupError(
            f"pair.draft={draft_name!r} has a vocabulary of {draft.args.vocab_size} tokens "
            f"(tokenizer {draft_tok.vocab_size}) that differs from the target's "
            f"{target.args.vocab_size} ({target_tok.vocab_size}): a draft must share the "
            "target's tokenizer; choose a draft trained for this target")


def make_draft(exp: ExperimentConfig, target: Transformer, tokenizer: Tokenizer,
               params: SamplingParams) -> Draft | None:
    d = exp.pair.draft
    if exp.schedule.name == "ar":
        return None
    if d.kind == "ngram":
        return NgramDraft(d.ngram, target.args.vocab_size)
    if d.kind == "early_exit":
        if not 1 <= d.exit_layer < target.args.n_layers:
            raise RealSetupError(f"pair.draft.exit_layer={d.exit_layer} must be in [1, "
                                 f"{target.args.n_layers - 1}] for this target")
        return EarlyExitDraft(target, d.exit_layer, params)
    model, tok = load(d.path, "pair.draft", d.name, exp.real.dtype)
    check_vocab(tokenizer, target, tok, model, d.name)
    return ModelDraft(model, params, d.name)


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
    return out


# ---------------------------------------------------------------------------------- schedules
Schedule = Callable[["RealContext", RealRequest], None]


@dataclass
class RealContext:
    exp: ExperimentConfig
    target: TargetRunner
    draft: Draft | None
    rec: RunRecorder
    eos: frozenset[int]
    params: SamplingParams
    on_tokens: Callable[[int], None]
    t0: float  # the run's time origin: recorded times are seconds since it

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def generator(self, request_id: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.exp.seed * 1_000_003 + request_id)


def _finish(out: list[int], new: list[int], n_max: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Append ``new`` up to ``n_max`` tokens in total, stopping after an EOS token."""
    for t in new:
        if len(out) >= n_max:
            return out, True
        out.append(t)
        if t in eos:
            return out, True
    return out, len(out) >= n_max


def serve_ar(ctx: RealContext, req: RealRequest) -> None:
    rec, rid, gen = ctx.rec, req.request_id, ctx.generator(req.request_id)
    ids = list(req.prompt_ids)
    s = ctx.now()
    ctx.target.prefill(ids)
    prefill_s = ctx.now() - s
    rec.span("target", "prefill", s, s + prefill_s, rid)
    start = ctx.now()
    out: list[int] = []
    done, i = False, 0
    while not done:
        s = ctx.now()
        p = ctx.target.probs([ids[-1]], len(ids) - 1)[0]
        t = int(p.argmax()) if ctx.params.greedy else sample(p, gen)
        e = ctx.now()
        ids.append(t)
        out, done = _finish(out, [t], req.max_new_tokens, ctx.eos)
        rec.round(rid, i, s, e, 0, 0, 0, 1, 1, 0.0, e - s)
        rec.span("target", "decode", s, e, rid, i)
        ctx.on_tokens(1)
        i += 1
    rec.request(rid, req.prompt_id, len(req.prompt_ids), out, len(out), prefill_s, ctx.now() - start, i)


def serve_sync(ctx: RealContext, req: RealRequest) -> None:
    assert ctx.draft is not None
    exp, rec, rid, draft = ctx.exp, ctx.rec, req.request_id, ctx.draft
    gen = ctx.generator(req.request_id)
    policy = make_lookahead(exp.lookahead.policy, exp.schedule.gamma)
    ids = list(req.prompt_ids)
    s = ctx.now()
    ctx.target.prefill(ids)
    m = ctx.now()
    draft.start(ids)
    prefill_s = ctx.now() - s
    rec.span("target", "prefill", s, m, rid)
    rec.span("draft", "prefill", m, s + prefill_s, rid)
    start = ctx.now()
    out: list[int] = []
    done, r = False, 0
    while not done:
        gamma = policy.next_gamma()
        s = ctx.now()
        guesses, q = draft.propose(ids, gamma, gen)
        m = ctx.now()
        p = ctx.target.probs([ids[-1], *guesses], len(ids) - 1)
        step = speculative_step(p, q, torch.tensor(guesses, dtype=torch.long), gen)
        e = ctx.now()
        n, k = step.accepted, len(guesses)
        ids.extend(step.tokens)
        draft.commit(ids, n, k)
        before = len(out)
        out, done = _finish(out, step.tokens, req.max_new_tokens, ctx.eos)
        policy.observe(k, n)
        rec.round(rid, r, s, e, k, n + (n < k), n, len(out) - before, k + 1, m - s, e - m)
        rec.span("draft", "draft", s, m, rid, r)
        rec.span("target", "verify", m, e, rid, r)
        ctx.on_tokens(len(out) - before)
        r += 1
    rec.request(rid, req.prompt_id, len(req.prompt_ids), out, len(out), prefill_s, ctx.now() - start, r)


SCHEDULES: dict[str, Schedule] = {"ar": serve_ar, "sync": serve_sync}


# --------------------------------------------------------------------------------------- run
@contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _progress(total: int, enabled: bool, desc: str):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False, dynamic_ncols=True)


def serve(exp: ExperimentConfig, schedule: str, target: Transformer, draft: Draft | None,
          requests: list[RealRequest], eos: frozenset[int], progress: bool) -> RunRecorder:
    if schedule not in SCHEDULES:
        raise RealSetupError(f"schedule={schedule} is not available on backend=real yet: "
                             f"use one of {', '.join(SCHEDULES)} (or backend=sim)")
    params = SamplingParams(exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p)
    rec = RunRecorder()
    total = sum(r.max_new_tokens for r in requests)
    with _progress(total, progress, f"real {schedule}") as bar:
        ctx = RealContext(exp, TargetRunner(target, params), draft, rec, eos, params, bar.update,
                          time.perf_counter())
        for req in requests:
            SCHEDULES[schedule](ctx, req)
    return rec


def baseline_key(exp: ExperimentConfig, requests: list[RealRequest]) -> str:
    key = {"target": as_dict(exp.pair.target), "real": as_dict(exp.real), "sampling": as_dict(exp.sampling),
           "seed": exp.seed, "requests": [(r.prompt_id, r.prompt_ids, r.max_new_tokens) for r in requests]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def run(exp: ExperimentConfig) -> RunResult:
    with _threads(exp.real.threads), torch.inference_mode():
        return _run(exp)


def _run(exp: ExperimentConfig) -> RunResult:
    t = exp.pair.target
    target, tokenizer = load(t.path, "pair.target", t.name, exp.real.dtype)
    draft = make_draft(exp, target, tokenizer, SamplingParams(
        exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p))
    requests = build_requests(exp, tokenizer, target.args.max_seq_len)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + exp.schedule.gamma + 2
    if target.max_seq < longest:
        target.setup_cache(longest)
    if isinstance(draft, ModelDraft) and draft.model.max_seq < longest:
        draft.model.setup_cache(longest)
    eos = frozenset() if exp.real.ignore_eos else frozenset(tokenizer.eos_token_ids)
    telemetry = Telemetry(exp.real.device)
    with telemetry:
        rec = serve(exp, exp.schedule.name, target, draft, requests, eos, exp.real.progress)
    baseline = None
    if exp.schedule.name != "ar" and exp.real.baseline:
        key = baseline_key(exp, requests)
        if key not in _BASELINES:
            _BASELINES[key] = serve(exp, "ar", target, None, requests, eos, exp.real.progress)
        baseline = _BASELINES[key]
    extra = {"draft": None if draft is None else draft.name, "dtype": exp.real.dtype,
             "threads": torch.get_num_threads(), "workload_split": exp.workload.split,
             "max_new_tokens": exp.workload.max_new_tokens}
    return RunResult(recorder=rec, baseline=baseline, extra=extra,
                     artifacts={"telemetry.parquet": telemetry.frame(),
                                "run_info.json": {"telemetry": telemetry.summary()}})
