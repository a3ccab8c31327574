"""backend=real schedule=async (real/schedules/async_tree.py, real/runtime/async_run.py): two device
groups running SwiftSpec Algorithm 1 concurrently.

Multi-process runs use tiny random checkpoints (tests/helpers/tiny_checkpoint.py); the sampling test and
the compaction test drive the two worker functions in this process (LoopbackTransport, threads,
or a scripted peer)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from real.errors import RealSetupError, WorkerFailed
from real.model.decoder import Transformer
from real.model.tree_tokens import LocalModel
from real.runtime.context import RealRequest
from real.runtime.links import Kind, Message
from real.runtime.loopback import LoopbackTransport
from real.schedules.async_tree import Peer, Side, draft_worker, target_worker, unpack_batch
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from tests.conftest import compose_exp
from tests.helpers import async_workers as aw
from tests.helpers.processes import assert_promised_files, live_workers
from tests.helpers.real_models import (
    TINY,
    TWO_TOKEN_PROMPT,
    exact_two_token_law,
    tiny,
    two_token_pair,
    two_token_tv,
)
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint
from tests.helpers.tree_fakes import Replay

two_cores = pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2,
                               reason="needs two cores (one worker per core)")




@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_checkpoint(root / "target", seed=1, layers=3)
    draft = write_tiny_checkpoint(root / "draft", seed=2, layers=3, base=target, noise=0.3)
    return target, draft


def _exp(target: Path, draft: Path, *extra: str):  # type: ignore[no-untyped-def]
    return compose_exp("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
                       "workload.num_prompts=2", "workload.max_new_tokens=20", "real.ignore_eos=true",
                       "real.progress=false", "schedule=async", "schedule.tree_width=3",
                       "schedule.tree_budget=6", *extra)


# ----------------------------------------------------------------- two processes, T = 0
@two_cores
def test_async_on_two_processes_equals_ar_at_temperature_0(tiny_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    exp = _exp(*tiny_pair)
    res = run(exp)
    assert_promised_files(tmp_path, exp, res)
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 20 for o in spec)
    assert res.extra["processes"] == 2 and res.extra["tree_depth_used"] >= 1
    # d from the two probe times by the simulator's rule (t_draft: one whole expansion)
    from testbed.spec.tree_drafter import async_depth

    x = res.extra
    assert x["tree_depth_used"] == async_depth(tree_depth=0, t_target=x["t_target_ms"], t_draft=x["t_draft_ms"])
    # each group timed its model's probe forward before decoding (sim.profile_drift=run_probe)
    assert x["probe_target_s"] > 0 and x["probe_draft_s"] > 0
    assert x["probe_target_k8_s"] > 0 and x["probe_draft_k8_s"] > 0
    rounds, _, timeline = res.recorder.frames()
    assert (rounds.verified_tokens <= 6).all() and (rounds.accepted <= rounds.drafted).all()
    kinds = set(zip(timeline.resource, timeline.kind))
    assert {("draft", "expand"), ("draft", "reroot"), ("target", "verify"),
            ("link draft->target", "link"), ("link target->draft", "link")} <= kinds
    # one clock: every verification starts after the subtree it verifies was sent
    sent = timeline[timeline.resource == "link draft->target"]
    assert len(sent) >= len(rounds) and (sent.start_s >= 0).all()
    assert live_workers() == []


@two_cores
def test_async_repeats_alternate_whole_runs_with_ar_and_give_intervals(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    """real.repeats=2 under async (processes launched per run): async, ar, async, ar; every pass
    lossless; the summary carries the intervals over both passes."""
    from real.runtime.engine import run

    res = run(_exp(*tiny_pair, "real.repeats=2"))
    x = res.extra
    assert x["repeats"] == 2
    assert x["measure_order"] == ["async#0", "ar#0", "async#1", "ar#1"]
    assert [s["config"] for s in x["machine_states"]] == ["async+ar", "async+ar"]
    for key in ("tokens_per_s_ci95", "tokens_per_s_mean_ci95", "speedup_ci95"):
        lo, hi = x[key]
        assert lo <= hi
    assert len(x["repeat_tokens_per_s"]["async"]) == 2 and len(x["repeat_tokens_per_s"]["ar"]) == 2
    # the run's files are the first pass's, which is still equal to ar at temperature 0
    assert [r["output_ids"] for r in res.recorder.requests] == [r["output_ids"] for r in res.baseline.requests]
    assert live_workers() == []


@two_cores
def test_async_with_the_ngram_draft_equals_ar_on_two_processes(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    """The n-gram draft (no model) grows the tree in the draft group's process."""
    from real.runtime.engine import run

    target, _ = tiny_pair
    res = run(compose_exp("backend=real", "pair=smollm2_135m+ngram3", f"pair.target.path={target}",
                          "workload.num_prompts=3", "workload.max_new_tokens=24", "real.ignore_eos=true",
                          "real.progress=false", "schedule=async", "schedule.tree_width=2",
                          "schedule.tree_budget=5", "schedule.tree_depth=2"))
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 24 for o in spec) and res.extra["processes"] == 2
    assert res.extra["draft"] == "ngram3" and res.extra["tree_depth_used"] == 2
    assert res.extra["probe_target_s"] > 0 and "probe_draft_s" not in res.extra  # no forward to probe
    assert "probe_draft_k8_s" not in res.extra
    assert live_workers() == []


def test_async_with_a_draft_without_tree_is_a_one_line_error() -> None:
    from real.runtime.async_run import check_draft

    exp = compose_exp("pair=smollm2_135m+smollm2_draft")
    exp.pair.draft.kind = "early_exit"  # validation refuses it too; the launcher checks again
    with pytest.raises(RealSetupError, match=r"pair.draft=.*cannot grow a token tree"):
        check_draft(exp)


# ------------------------------------------------------------------------------- faults
@two_cores
@pytest.mark.parametrize("role", ["draft", pytest.param("target", marks=pytest.mark.slow)])
def test_a_killed_worker_ends_the_async_run_within_30_s(tiny_pair, role: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.launch import launch

    exp = _exp(*tiny_pair, "real.recv_timeout_s=20")
    stamp = tmp_path / "killed"
    with pytest.raises(WorkerFailed) as e:
        launch(exp, aw.async_rank_killed, args=(role, str(stamp)), timeout_s=240)
    rank = 0 if role == "target" else 1
    assert str(e.value) == f"rank {rank} ({role}) died: killed by SIGKILL"
    assert time.time() - float(stamp.read_text()) < 30
    assert live_workers() == []


# --------------------------------------------------------- in process: T = 1 sampling
def _threads_run(target: Transformer, draft: Transformer | None, params: SamplingParams,
                 requests: list[RealRequest], *, depth: int, width: int, budget: int,
                 seed: int, ngram: int = 0) -> RunRecorder:
    """Both worker functions in this process, joined by a LoopbackTransport (one thread each);
    ``draft=None``: the n-gram draft (``ngram``) instead of a model."""
    from real.runtime.async_run import ngram_source
    ends = LoopbackTransport.connect("bridge", (0, 1), recv_timeout_s=30.0)
    rec = RunRecorder(keep_spans=False)

    exp = compose_exp("pair=smollm2_135m+ngram3", f"pair.draft.ngram={max(ngram, 1)}")
    source = ngram_source(exp, params, target.args.vocab_size) if draft is None else None

    def side(model: Transformer | None, me: int) -> Side:
        return Side(model, LocalModel(model) if model is not None else None, params,
                    Peer(ends[me], ends[me], lambda m: m),
                    rec if me == 0 else RunRecorder(keep_spans=False), time.perf_counter, seed,
                    draft_source=source if me == 1 else None)

    errors: list[BaseException] = []

    def drafting() -> None:
        try:
            d = side(draft, 1)
            for req in requests:
                draft_worker(d, req, depth, width=width, budget=budget)
        except BaseException as e:  # noqa: BLE001 — reported by the test
            errors.append(e)

    thread = threading.Thread(target=drafting)
    thread.start()
    t = side(target, 0)
    try:
        for req in requests:
            target_worker(t, req, frozenset())
    finally:
        thread.join(60)
        for end in ends.values():
            end.close()
    assert not errors, errors
    return rec


def test_async_samples_the_target_distribution_at_temperature_1() -> None:
    """Two-token continuations of a fixed prompt under branching trees (w=2, bs=5, d=2): the
    empirical distribution matches the exact target distribution within a fixed TV tolerance."""
    target, draft = two_token_pair(1)
    params = SamplingParams(temperature=1.0)
    prompt = TWO_TOKEN_PROMPT
    p_exact = exact_two_token_law(target, params)
    n = 1200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            rec = _threads_run(target, draft, params, [RealRequest(i, "p", prompt, 2) for i in range(n)],
                               depth=2, width=2, budget=5, seed=3)
    finally:
        torch.set_num_threads(threads)
    tv = two_token_tv(rec.requests, p_exact)
    assert tv < 0.08, tv  # E[TV] of 1200 exact samples over 16 outcomes is ≈ 0.045
    rounds = rec.frames()[0]
    assert 0 < rounds.accepted.mean() < 2


def test_threads_run_equals_greedy_decoding_at_temperature_0() -> None:
    target, draft = tiny(0), tiny(1)
    target.setup_cache(256)
    draft.setup_cache(256)
    gen = torch.Generator().manual_seed(7)
    reqs = [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (4 + 3 * i,), generator=gen).tolist(), 16)
            for i in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            rec = _threads_run(target, draft, SamplingParams(), reqs, depth=3, width=3, budget=6, seed=0)
    finally:
        torch.set_num_threads(threads)
    with torch.inference_mode():
        for req, got in zip(reqs, rec.requests):
            ids = list(req.prompt_ids)
            target.truncate(0)
            for _ in range(16):
                ids.append(int(target(torch.tensor([ids]), input_pos=0)[0, -1].argmax()))
                target.truncate(0)
            assert got["output_ids"] == ids[len(req.prompt_ids):]


@pytest.mark.parametrize("width,budget,depth", [(1, 4, 1), (3, 6, 2), (2, 8, 4)])
def test_ngram_threads_run_equals_greedy_decoding_at_temperature_0(width, budget, depth) -> None:  # type: ignore[no-untyped-def]
    """Several prompts with repeats (so lookups hit) and without."""
    target = tiny(0)
    target.setup_cache(256)
    gen = torch.Generator().manual_seed(11)
    motif = [5, 17, 42, 8]
    prompts = [motif * 3 + [5, 17], torch.randint(0, TINY.vocab_size, (7,), generator=gen).tolist(),
               [1, 2, 3, 1, 2, 3, 1, 2], motif + [9, 9, 9, 9, 9]]
    reqs = [RealRequest(i, f"p{i}", p, 16) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        rec = _threads_run(target, None, SamplingParams(), reqs, depth=depth, width=width,
                           budget=budget, seed=0, ngram=3)
        for req, got in zip(reqs, rec.requests):
            ids = list(req.prompt_ids)
            for _ in range(16):
                target.truncate(0)
                ids.append(int(target(torch.tensor([ids]), input_pos=0)[0, -1].argmax()))
            assert got["output_ids"] == ids[len(req.prompt_ids):]
    assert rec.frames()[0].accepted.sum() > 0  # the lookups did propose accepted tokens


def test_ngram_async_samples_the_target_distribution_at_temperature_1() -> None:
    """Count-based n-gram trees (several candidates per node) at T=1: two-token continuations
    match the exact target distribution within a fixed TV tolerance."""
    target, _ = two_token_pair(1)
    params = SamplingParams(temperature=1.0)
    prompt = [0, 1, 2, 0, 3, 0, 1, 0]  # after "0": 1 twice, 3 once -> two candidates
    p_exact = exact_two_token_law(target, params, prompt)
    n = 1200
    with torch.inference_mode():
        rec = _threads_run(target, None, params, [RealRequest(i, "p", prompt, 2) for i in range(n)],
                           depth=2, width=2, budget=5, seed=3, ngram=2)
    tv = two_token_tv(rec.requests, p_exact)
    assert tv < 0.08, tv  # E[TV] of 1200 exact samples over 16 outcomes is ≈ 0.045
    rounds = rec.frames()[0]
    assert 0 < rounds.accepted.mean() < 2


# ------------------------------------------ the draft side's re-root and KV compaction
class ScriptedTarget:
    """The target group as the draft worker sees it: answers each subtree with verified tokens
    chosen by the test (a walk down the subtree, then a bonus token), then STOP."""

    def __init__(self, walks: list[tuple[list[int], int]]) -> None:
        self.walks, self.pending = list(walks), None
        self.sent: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv(self) -> Message:
        msg = self.sent[-1]
        if not self.walks:
            return Message(Kind.STOP, request_id=msg.request_id, round=msg.round, version=msg.version)
        choices, bonus = self.walks.pop(0)
        batch, _, _ = unpack_batch(msg, "topk")
        node, tokens = 0, []
        for c in choices:
            if not batch.children[node]:
                break
            node = batch.children[node][c % len(batch.children[node])]
            tokens.append(batch.tokens[node])
        tokens.append(bonus)
        return Message(Kind.VERIFIED, request_id=msg.request_id, round=msg.round, version=msg.version,
                       committed=msg.committed + len(tokens), tensors=(torch.tensor(tokens),))


walks = st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=4), st.integers(0, TINY.vocab_size - 1)),
                 min_size=1, max_size=5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks=walks, depth=st.integers(0, 3), width=st.integers(1, 3), budget=st.integers(2, 7))
def test_draft_cache_after_async_reroots_equals_a_recomputation(walks, depth, width, budget) -> None:  # type: ignore[no-untyped-def]
    """The real draft worker, fed random verified sequences by a scripted target: afterwards
    every computed prefix slot and every expanded tree node's slot of its KV cache equal a
    from-scratch forward over the same tokens at the same positions."""
    model = _model(5)
    prompt = [3, 14, 15, 92, 65, 35]
    peer = ScriptedTarget(walks)
    side = Side(model, LocalModel(model), SamplingParams(), Peer(None, None, lambda m: m),
                RunRecorder(keep_spans=False), time.perf_counter, 0)
    side.peer = peer  # type: ignore[assignment]
    with torch.inference_mode():
        drafter = draft_worker(side, RealRequest(0, "p", prompt, 100), depth, width=width, budget=budget)
        tree, source = drafter.tree, drafter.source
        history = source.history()
        ref = _model(5)
        ref(torch.tensor([history[:-1]]), input_pos=0)
        computed = [p for p in range(tree.prefix_len) if p not in source.pending]
        for layer, ref_layer in zip(model.layers, ref.layers):
            for name in ("k_cache", "v_cache"):
                got = getattr(layer.attention.kv_cache, name)[:, :, computed]
                assert torch.allclose(got, getattr(ref_layer.attention.kv_cache, name)[:, :, computed], atol=1e-5)
        for node in range(len(tree.tokens)):
            if tree.slots[node] < 0:
                continue
            path = [tree.tokens[n] for n in tree.path(node)]
            ref.truncate(0)
            ref(torch.tensor([history[:-1] + path]), input_pos=0)
            pos = tree.prefix_len + len(path) - 1
            for layer, ref_layer in zip(model.layers, ref.layers):
                for name in ("k_cache", "v_cache"):
                    got = getattr(layer.attention.kv_cache, name)[:, :, tree.prefix_len + tree.slots[node]]
                    want = getattr(ref_layer.attention.kv_cache, name)[:, :, pos]
                    assert torch.allclose(got, want, atol=1e-5)
    assert len(peer.sent) == len(walks) + 1
    assert [m.version for m in peer.sent] == list(range(len(walks) + 1))


def test_the_target_refuses_a_subtree_rooted_on_a_stale_root() -> None:
    """A subtree whose version or root is not the round the target is in is never verified."""
    from real.schedules.async_tree import StaleTree, pack_batch
    from testbed.spec.tree import DraftTree

    prompt = [3, 14, 15, 92]
    tree = DraftTree(root_token=prompt[-1], prefix_len=len(prompt) - 1)
    batch = tree.select_subtree(1)
    good = Message(Kind.TREE, request_id=0, round=0, version=0, committed=len(prompt),
                   tensors=pack_batch(batch, 0.0, 0.0))
    # round 1 expects version 1 rooted after len(prompt) + 1 tokens: an old subtree, or a new
    # version built on the old root, is stale
    for stale in ({"version": 0, "committed": len(prompt) + 1}, {"version": 1, "committed": len(prompt)}):
        model = _model(0)
        peer = Replay([good, Message(**{**good.__dict__, "round": 1, **stale})])
        side = Side(model, LocalModel(model), SamplingParams(), peer, RunRecorder(), time.perf_counter, 0)  # type: ignore[arg-type]
        with torch.inference_mode(), pytest.raises(StaleTree, match="round 1"):
            target_worker(side, RealRequest(0, "p", prompt, 8), frozenset())
        assert len(peer.sent) == 1 and peer.sent[0].kind == Kind.VERIFIED  # round 0 only


def _model(seed: int) -> Transformer:
    model = tiny(seed)
    model.setup_cache(256)
    model.truncate(0)
    return model


# -------------------------------------------------------------------- the bundled pair
@pytest.mark.model
# slow: both worker processes load the bundled GGUF (~35 CPU-s); by default async is held to
# `ar` on two processes by test_async_on_two_processes_equals_ar_at_temperature_0 (a model
# draft) and test_async_with_the_ngram_draft_equals_ar_on_two_processes, on tiny checkpoints
@pytest.mark.slow
@two_cores
def test_bundled_pair_async_equals_ar_at_temperature_0() -> None:
    from real.runtime.engine import run

    res = run(compose_exp("backend=real", "schedule=async", "workload.num_prompts=2",
                          "workload.max_new_tokens=24", "real.ignore_eos=true", "real.progress=false"))
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 24 for o in spec)
    assert live_workers() == []


@pytest.mark.model
@pytest.mark.slow  # (the default run has async with a model draft and the n-gram draft on tiny models)
@two_cores
def test_bundled_target_with_the_ngram_draft_async_equals_ar_at_temperature_0() -> None:
    from real.runtime.engine import run

    res = run(compose_exp("backend=real", "schedule=async", "pair=smollm2_135m+ngram3",
                          "workload.num_prompts=3", "workload.max_new_tokens=24",
                          "real.ignore_eos=true", "real.progress=false"))
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 24 for o in spec)
    assert live_workers() == []
