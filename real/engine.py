"""The real backend: load the pair (real.loading), serve the workload's prompts one after
another (batch 1) with the schedule of real/schedules, time every round on the wall clock and
record it exactly as the simulator does.

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
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from real.context import RealContext, RealRequest
from real.drafts import Draft, ModelDraft
from real.errors import RealSetupError
from real.loading import build_requests, load, make_draft
from real.model import Transformer
from real.runners import TargetRunner
from real.schedules import get_schedule
from real.telemetry import Telemetry
from real.tree_tokens import tree_cache_slots
from testbed.config import ExperimentConfig, as_dict
from testbed.recorder import RunRecorder, RunResult
from testbed.schedules import implementations, runs_on, schedule_impl
from testbed.spec.sampling import SamplingParams

_BASELINES: dict[str, RunRecorder] = {}


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
          requests: list[RealRequest], eos: frozenset[int], progress: bool,
          extra: dict | None = None) -> RunRecorder:
    """Serve the requests one after another; the schedule's summary fields go into ``extra``."""
    if not runs_on("real", schedule):
        raise RealSetupError(f"schedule={schedule} is not available on backend=real yet: "
                             f"use one of {', '.join(implementations('real'))} (or backend=sim)")
    serve_one = get_schedule(schedule)
    params = SamplingParams(exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p)
    rec = RunRecorder()
    total = sum(r.max_new_tokens for r in requests)
    with _progress(total, progress, f"real {schedule}") as bar:
        ctx = RealContext(exp, TargetRunner(target, params), draft, rec, eos, params, bar.update,
                          time.perf_counter())
        for req in requests:
            serve_one(ctx, req)
    if extra is not None:
        extra.update(ctx.extra)
    return rec


def baseline_key(exp: ExperimentConfig, requests: list[RealRequest]) -> str:
    key = {"target": as_dict(exp.pair.target), "real": as_dict(exp.real), "sampling": as_dict(exp.sampling),
           "seed": exp.seed, "requests": [(r.prompt_id, r.prompt_ids, r.max_new_tokens) for r in requests]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def cache_slots(exp: ExperimentConfig, requests: list[RealRequest]) -> tuple[int, int]:
    """KV slots (target, draft) the longest request needs: its sequence and the draft window;
    for token trees the target's verification batch, and the draft's tree slots alive at once
    (``tree_cache_slots``: the model's whole context where it can)."""
    s = exp.schedule
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    if s.tree or s.name == "async":
        return longest + s.tree_budget + 2, tree_cache_slots(longest)
    return longest + s.gamma + 2, longest + s.gamma + 2


def run(exp: ExperimentConfig) -> RunResult:
    with _threads(exp.real.threads), torch.inference_mode():
        return _run(exp)


def _run(exp: ExperimentConfig) -> RunResult:
    t = exp.pair.target
    target, tokenizer = load(t.path, "pair.target", t.name, exp.real.dtype)
    draft = make_draft(exp, target, tokenizer, SamplingParams(
        exp.sampling.temperature, exp.sampling.top_k, exp.sampling.top_p))
    requests = build_requests(exp, tokenizer, target.args.max_seq_len)
    target_slots, draft_slots = cache_slots(exp, requests)
    if target.max_seq < target_slots:
        target.setup_cache(target_slots)
    if isinstance(draft, ModelDraft) and draft.model.max_seq < draft_slots:
        draft.model.setup_cache(draft_slots)
    eos = frozenset() if exp.real.ignore_eos else frozenset(tokenizer.eos_token_ids)
    telemetry = Telemetry(exp.real.device)
    schedule_extra: dict = {}
    with telemetry:
        rec = serve(exp, schedule_impl(exp), target, draft, requests, eos, exp.real.progress,
                    schedule_extra)
    baseline = None
    if exp.schedule.name != "ar" and exp.real.baseline:
        key = baseline_key(exp, requests)
        if key not in _BASELINES:
            _BASELINES[key] = serve(exp, "ar", target, None, requests, eos, exp.real.progress)
        baseline = _BASELINES[key]
    extra = {"draft": None if draft is None else draft.name, "dtype": exp.real.dtype,
             "threads": torch.get_num_threads(), "workload_split": exp.workload.split,
             "max_new_tokens": exp.workload.max_new_tokens, **schedule_extra}
    return RunResult(recorder=rec, baseline=baseline, extra=extra,
                     artifacts={"telemetry.parquet": telemetry.frame(),
                                "run_info.json": {"telemetry": telemetry.summary()}})
