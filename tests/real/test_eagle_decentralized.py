"""An eagle head on the first stage of `decentralized` (real/schedules/decentralized.py): the last
stage returns the target's features with its answers, the head takes them, the output is `ar`'s.

The in-process tests run the two stages on two threads joined by LoopbackTransports (the stage
functions of real/runtime/pipeline.py, no processes); one test runs the stage processes."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from real.model.decoder import Transformer
from real.model.drafts import Draft
from real.model.eagle import EagleDraft, EagleHead, load_head, save_head
from real.model.runners import TargetRunner
from real.runtime.context import RealContext, RealRequest
from real.runtime.links import Kind, Message
from real.runtime.pipeline import Stage, Verify, ar_pipeline
from real.schedules.ar import serve_ar
from real.schedules.decentralized import dsd_first_stage, make_verifier
from testbed.links import dsd_prompt_answer_bytes, dsd_verified_bytes
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.helpers.real_models import TINY, tiny
from tests.helpers.ring import run_ring
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint


def _ring(stages: tuple[Transformer, Transformer], draft: Draft, exp, requests: list[RealRequest],  # type: ignore[no-untyped-def]
          *, make_verify: Callable[[Message], Verify], baseline: bool = False,
          ) -> tuple[RunRecorder, list[Message]]:
    """The requests through a two-stage ring (stage1 on a thread, returning features), then
    with ``baseline`` through `ar` over it: (the schedule's records, every message stage1 sent)."""
    sent: list[Message] = []
    rec = RunRecorder(keep_spans=False)
    first, last = stages

    def serve(s0: Stage) -> None:
        for req in requests:
            dsd_first_stage(s0, draft, req, frozenset(), exp=exp, rec=rec, send_dists=False)
        if baseline:
            for req in requests:
                ar_pipeline(s0, req, frozenset(), None, rec=RunRecorder(keep_spans=False))

    run_ring(first, last, split=first.args.n_layers // 2, make_verify=make_verify, serve=serve, rec=rec,
             features=True, sent=sent)
    return rec, sent


def _stage_models(model: Transformer, slots: int) -> tuple[Transformer, Transformer]:
    """Two copies of ``model``, each with a KV cache for its half of the layers only."""
    half = model.args.n_layers // 2
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.setup_cache(slots, layers=(0, half))
    last.setup_cache(slots, layers=(half, model.args.n_layers))
    return first, last


def _serve(serve, exp, model: Transformer, requests: list[RealRequest], *,  # type: ignore[no-untyped-def]
           draft: Draft | None = None) -> RunRecorder:
    """``serve`` (a schedule of real/schedules) over the requests in one process (greedy; no EOS)."""
    params = SamplingParams()
    ctx = RealContext(exp, TargetRunner(model, params), draft, RunRecorder(), frozenset(), params,
                      lambda n: None, 0.0)
    for req in requests:
        serve(ctx, req)
    return ctx.rec


def test_eagle_decentralized_configs_are_accepted_on_the_real_backend() -> None:
    exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", "schedule=decentralized",
                      "placement.nodes=2")
    assert exp.pair.draft.kind == "eagle" and exp.placement.nodes == 2


# ---------------------------------------------------- the feature hand-off, tiny fp32 model
def _forced_verify(log: list[list[int]]) -> Callable[[Message], Verify]:
    """A verifier that accepts 0, 1, 2, 0, ... of the guesses (a random head's would all be
    rejected), then the target's own token: the accepted rows of the features are handed over
    too. It logs every emitted window (the committed sequence, rebuilt by the test)."""
    def make(msg: Message) -> Verify:
        def verify(logits: torch.Tensor, window: Message) -> list[int]:
            guesses = window.tensors[1].long().tolist()[1:]
            a = min(len(guesses), len(log) % 3)
            emitted = guesses[:a] + [int(logits[a].argmax())]
            if window.version == 0:  # the schedule's windows (not the ar baseline's)
                log.append(emitted)
            return emitted
        return verify
    return make


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_first_stage_s_features_equal_a_recomputation_from_scratch(nodes: int) -> None:
    """After rounds that accept drafted tokens, the head's features are the target's hidden
    states of the whole committed sequence (one forward from scratch), and its next proposal is
    a fresh head's that started from that sequence: handed over by the last stage (2 nodes), or
    read from the target in this process (1 node: the stage runs every layer and verifies)."""
    params = SamplingParams()
    target = tiny(0)
    head = EagleHead(target.args).init_random(3)
    prompt = torch.randint(0, TINY.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    exp = compose_exp("schedule=decentralized", "schedule.gamma=3")
    log: list[list[int]] = []
    req = RealRequest(0, "p", prompt, 16)
    if nodes == 2:
        first, last = _stage_models(target, TINY.max_seq_len)
        draft = EagleDraft(head, first, params, "eagle")
        with torch.inference_mode():
            _ring((first, last), draft, exp, [req], make_verify=_forced_verify(log), baseline=True)
    else:
        only = copy.deepcopy(target)
        draft = EagleDraft(head, only, params, "eagle")
        stage = Stage(only, (0, TINY.n_layers), 0, 1, None, None, RunRecorder(keep_spans=False),
                      time.perf_counter, features=True)
        verify = _forced_verify(log)(Message(Kind.ACTIVATIONS))
        with torch.inference_mode():
            dsd_first_stage(stage, draft, req, frozenset(), exp=exp, rec=stage.rec, send_dists=False,
                            verify=verify)
    ids = prompt + [t for window in log for t in window]
    assert sum(len(w) - 1 for w in log) >= 4  # drafted tokens were accepted
    assert draft.known == len(ids) - 1  # f_0 .. f_{n-2}: every committed token but the last
    fresh_target = copy.deepcopy(target)
    fresh_target.setup_cache(TINY.max_seq_len)
    with torch.inference_mode():
        want = fresh_target.forward_layers(fresh_target.embed(torch.tensor([ids[:-1]])), 0)[0]
        torch.testing.assert_close(draft.features[: draft.known], want, atol=1e-5, rtol=1e-4)
        guesses, q = draft.propose(ids, 4, None)
        fresh = EagleDraft(copy.deepcopy(head), fresh_target, params, "eagle")
        try:
            TargetRunner(fresh_target, params).prefill(ids)
            fresh.start(ids)
            fresh_guesses, fresh_q = fresh.propose(ids, 4, None)
        finally:
            fresh_target.keep_hidden = False
    assert guesses == fresh_guesses
    torch.testing.assert_close(q, fresh_q, atol=1e-5, rtol=1e-4)


def test_the_last_stage_s_answers_carry_the_features_testbed_links_charges() -> None:
    """Every answer of the last stage carries exactly the bytes testbed.links charges (the
    simulator's charge, tests/sim/test_decentralized_sim.py): the features with the schedule's
    answers, none with the `ar` baseline's."""
    params = SamplingParams()
    target = tiny(0)
    first, last = _stage_models(target, TINY.max_seq_len)
    draft = EagleDraft(EagleHead(target.args).init_random(3), first, params, "eagle")
    prompt = list(range(3, 12))
    exp = compose_exp("schedule=decentralized", "schedule.gamma=3")
    with torch.inference_mode():
        _, sent = _ring((first, last), draft, exp, [RealRequest(0, "p", prompt, 10)],
                        make_verify=_forced_verify([]), baseline=True)
    size = {"hidden": TINY.dim, "act_bytes": 4}  # fp32 features
    schedule = [m for m in sent if m.version == 0]
    baseline = [m for m in sent if m.version == 1]
    assert [m.kind for m in schedule[:1] + baseline[:1]] == [Kind.DATA, Kind.DATA]
    assert schedule[0].payload_bytes == dsd_prompt_answer_bytes(len(prompt) - 1, **size, features=True)
    assert baseline[0].payload_bytes == dsd_prompt_answer_bytes(len(prompt) - 1, **size, features=False)
    verified = [m for m in schedule if m.kind == Kind.VERIFIED]
    assert len(verified) >= 3 and any(m.tensors[0].numel() > 1 for m in verified)
    for m in verified:
        assert m.payload_bytes == dsd_verified_bytes(m.tensors[0].numel(), **size, features=True)
    for m in baseline[1:]:
        assert m.kind == Kind.VERIFIED
        assert m.payload_bytes == dsd_verified_bytes(m.tensors[0].numel(), **size, features=False)


# ------------------------------------------------------------ the shipped head, bf16, T = 0
@pytest.mark.model
def test_the_shipped_eagle_head_through_two_stages_equals_ar_at_temperature_0() -> None:
    """SmolLM2-135M-Instruct in real.dtype=auto (bf16) split over two stages, models/smollm2-eagle
    on the first: 2 prompts x 24 tokens equal `ar`'s token for token (real/schedules/ar.py, in
    one process), and every round accepts what `sync` with the head accepts in one process (its
    guesses read the same features: a wrong hand-off is lossless but accepts less)."""
    from real.runtime.loading import build_requests, load
    from real.schedules.sync import serve_sync
    from testbed.config import real_dtype
    from testbed.paths import repo_path

    exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", "schedule=decentralized",
                      "placement.nodes=2", "schedule.gamma=4", "workload=mtbench",
                      "workload.num_prompts=2", "workload.max_new_tokens=24", "real.ignore_eos=true")
    assert real_dtype(exp) == "bf16"
    # the process's bf16 SmolLM2 (real.runtime.loading keeps one per process: in-process runs share it)
    model, tokenizer = load(None, "pair.target", model_name=exp.pair.target.name, dtype=real_dtype(exp))
    requests = build_requests(exp, tokenizer, model.args.max_seq_len)
    slots = max(len(r.prompt_ids) for r in requests) + 24 + exp.schedule.gamma + 2
    model.setup_cache(slots)
    head = load_head(repo_path(exp.pair.draft.path), model)
    first, last = _stage_models(model, slots)
    vocab = model.args.vocab_size
    with torch.inference_mode():  # as the engine serves
        ar = [r["output_ids"] for r in _serve(serve_ar, exp, model, requests).requests]
        try:
            sync = _serve(serve_sync, exp, model, requests,
                          draft=EagleDraft(head, model, SamplingParams(), "eagle"))
        finally:
            model.keep_hidden = False
        draft = EagleDraft(head, first, SamplingParams(), "eagle")
        rec, sent = _ring((first, last), draft, exp, requests,
                          make_verify=lambda m: make_verifier(exp, vocab, m.request_id, baseline=False))
    assert [r["output_ids"] for r in rec.requests] == ar and all(len(o) == 24 for o in ar)
    rounds, sync_rounds = rec.frames()[0], sync.frames()[0]
    assert rounds.accepted.tolist() == sync_rounds.accepted.tolist() and rounds.accepted.sum() > 0
    verified = [m for m in sent if m.kind == Kind.VERIFIED]
    assert all(m.tensors[1].dtype == torch.bfloat16 for m in verified)


# ------------------------------------------------------------------- stage processes
def test_decentralized_with_an_eagle_head_in_stage_processes_equals_ar(tmp_path: Path) -> None:
    """The whole run (real/runtime/pipeline_run.py): two stage processes, a tiny checkpoint and a
    head saved for it; the outputs equal the run's `ar` baseline over the same pipeline (which
    tests/real/test_real_pipeline.py holds to `ar` in one process), and no process is left."""
    from real.model.weights import load_model
    from real.runtime.engine import run

    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=4)
    model, _ = load_model(target, max_seq=64)
    save_head(EagleHead(model.args).init_random(0), tmp_path / "head", target_name="tiny")
    common = ("backend=real", "pair=smollm2_135m+smollm2_eagle", f"pair.target.path={target}",
              f"pair.draft.path={tmp_path / 'head'}", "pair.draft.draft_vocab=0", "pair.target.layers=4",
              "real.dtype=fp32",
              "workload.num_prompts=2", "workload.max_new_tokens=10", "real.ignore_eos=true",
              "real.progress=false")
    res = run(compose_exp(*common, "schedule=decentralized", "placement.nodes=2", "schedule.gamma=3",
                          "real.recv_timeout_s=60"))
    out = [r["output_ids"] for r in res.recorder.requests]
    assert out == [r["output_ids"] for r in res.baseline.requests] and all(len(o) == 10 for o in out)
    assert res.extra["processes"] == 2 and res.extra["draft"] == "smollm2_eagle"
    assert live_workers() == []
