"""`async` with an eagle head on real models (real/schedules/async_tree.py, real/runtime/async_run.py,
real/runtime/async_messages.py): the draft group drafts trees from the target's features, which
the target sends after its prefill and with every reply.

In process: the two worker functions on threads joined by a LoopbackTransport (tiny models), and
``async_rank`` of both groups on threads (what each worker process runs, loading included);
one multi-process run on tiny checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from real.model.decoder import Transformer
from real.model.eagle import EagleDraft, EagleHead, save_head
from real.model.tree_tokens import LocalModel
from real.runtime.async_messages import prompt_message, reply_message
from real.runtime.async_run import AsyncServed, eagle_hooks
from real.runtime.context import RealRequest
from real.runtime.links import Kind, Message
from real.runtime.loopback import LoopbackTransport
from real.schedules.async_tree import Peer, Side, draft_worker, target_worker
from testbed.links import features_bytes
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import TreeDrafter
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.helpers.real_models import TINY, tiny
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint
from tests.helpers.tree_fakes import Replay, forced_path
from tests.helpers.two_sides import run_both

two_cores = pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2,
                               reason="needs two cores (one worker per core)")
WIDE = dataclasses.replace(TINY, max_seq_len=512)  # room for the trees the draft keeps growing


class Recording(Peer):
    """A leader's end of the bridge that keeps what it sends (``tamper`` may alter it first)."""

    def __init__(self, end: LoopbackTransport, tamper=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(end, end, lambda m: m)
        self.sent: list[Message] = []
        self.tamper = tamper

    def send(self, msg: Message) -> None:
        msg = self.tamper(msg) if self.tamper is not None else msg
        self.sent.append(msg)
        super().send(msg)


@dataclasses.dataclass
class EagleRun:
    rec: RunRecorder
    replies: list[Message]  # what the target sent
    drafters: list[TreeDrafter]  # each request's, as it ended
    draft: EagleDraft


def _eagle_run(target: Transformer, head: EagleHead, requests: list[RealRequest], *, depth: int,
               width: int, budget: int, tamper=None) -> EagleRun:  # type: ignore[no-untyped-def]
    """Both worker functions on threads (the draft group's on its own copy of the target: its
    embedding, norm and LM head, never a forward), greedy, joined by a LoopbackTransport."""
    params = SamplingParams()
    ends = LoopbackTransport.connect("bridge", (0, 1), recv_timeout_s=30.0)
    draft = EagleDraft(head, copy.deepcopy(target), params, "eagle")
    source, start = eagle_hooks(draft, params, cache_slots=256)
    rec = RunRecorder(keep_spans=False)
    to_draft = Recording(ends[0], tamper)
    target_side = Side(target, LocalModel(target), params, to_draft, rec, time.perf_counter, 0,
                       reply_features=True)
    draft_side = Side(None, None, params, Peer(ends[1], ends[1], lambda m: m), RunRecorder(keep_spans=False),
                      time.perf_counter, 0, draft_source=source, start_features=start)
    drafters: list[TreeDrafter] = []

    def reset() -> None:
        target.keep_hidden = False

    run_both(lambda: [target_worker(target_side, req, frozenset()) for req in requests],
             lambda: drafters.extend(draft_worker(draft_side, req, depth, width=width, budget=budget)
                                     for req in requests), ends.values(), after=reset)
    return EagleRun(rec, to_draft.sent, drafters, draft)


def _requests(n: int, new: int) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(7)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (4 + 3 * i,), generator=gen).tolist(), new)
            for i in range(n)]


def _greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            model.truncate(0)
            ids.append(int(model(torch.tensor([ids]), input_pos=0)[0, -1].argmax()))
    return ids[len(prompt):]


# ------------------------------------------------------------------- tiny models, T = 0
@pytest.mark.parametrize("width,budget,depth", [(2, 4, 1), (3, 6, 3)])
def test_async_with_an_eagle_head_equals_greedy_decoding_at_temperature_0(width, budget, depth) -> None:  # type: ignore[no-untyped-def]
    target = tiny(0, WIDE)
    reqs = _requests(2, 16)
    run = _eagle_run(target, EagleHead(target.args).init_random(2), reqs, depth=depth, width=width, budget=budget)
    for req, got in zip(reqs, run.rec.requests):
        assert got["output_ids"] == _greedy(target, req.prompt_ids, 16)
    rounds = run.rec.frames()[0]
    assert (rounds.verified_tokens > 1).all()


def _features_after_reroots(monkeypatch, tamper=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """(the draft group's features of the committed prefix and its head's KV of the committed
    pairs, after async rounds that accepted drafted tokens; the same from scratch: the target's
    causal hidden states of the whole committed sequence, and a fresh head fed with them)."""
    from real.model import tree_tokens

    monkeypatch.setattr(tree_tokens, "verify_tree", forced_path)
    target = tiny(0, WIDE)
    head = EagleHead(target.args).init_random(4)
    req = RealRequest(0, "p", _requests(1, 0)[0].prompt_ids, 14)
    run = _eagle_run(target, head, [req], depth=2, width=3, budget=6, tamper=tamper)
    rounds = run.rec.frames()[0]
    assert (rounds.accepted[:-1] == 2).all() and len(rounds) >= 4  # re-roots on drafted pairs
    drafter = run.drafters[0]
    ids = drafter.source.history()
    n = len(ids) - 1  # the prefix: pairs 1 .. n-1 (the root, ids[n], is not a pair yet)
    with torch.inference_mode():
        drafter.expand()  # feeds the pending prefix pairs with the target's features
        kv = head.body.layers[0].attention.kv_cache
        got = [run.draft.features[:n].clone(), kv.k_cache[:, :, 1:n].clone(), kv.v_cache[:, :, 1:n].clone()]
        fresh_target, fresh_head = tiny(0, WIDE), copy.deepcopy(head)
        feats = fresh_target.forward_layers(fresh_target.embed(torch.tensor([ids[:n]])), 0)
        fresh_head.body.setup_cache(64)
        fresh_head(fresh_target, torch.tensor([ids[1:n]]), feats[:, : n - 1], 1)
        fkv = fresh_head.body.layers[0].attention.kv_cache
        want = [feats[0], fkv.k_cache[:, :, 1:n], fkv.v_cache[:, :, 1:n]]
    return got, want


def test_the_draft_group_s_features_after_reroots_equal_a_recomputation_from_scratch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """After async rounds that accept drafted tokens, the draft group's features of the committed
    prefix are the target's causal hidden states of the whole sequence, and its head's KV of the
    committed pairs equals a fresh head's fed them: the replies' features were placed at the
    right positions and the pairs drafted on the head's own features were fed again."""
    got, want = _features_after_reroots(monkeypatch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_features_one_position_off_in_the_reply_are_caught(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The check above fails when the replies' features are shifted by one token."""
    def shifted(msg: Message) -> Message:
        if msg.kind in (Kind.VERIFIED, Kind.STOP):
            tokens, feats = msg.tensors
            return dataclasses.replace(msg, tensors=(tokens, feats.roll(1, 0)))
        return msg

    got, want = _features_after_reroots(monkeypatch, tamper=shifted)
    assert not torch.allclose(got[0], want[0], atol=1e-3)


def test_a_reply_without_features_stops_the_eagle_draft() -> None:
    target = tiny(0, WIDE)
    params = SamplingParams()
    prompt = _requests(1, 0)[0].prompt_ids
    target.keep_hidden = True
    try:
        with torch.inference_mode():
            target.forward_layers(target.embed(torch.tensor([prompt[:-1]])), 0)
            feats = target.last_hidden[0].clone()
    finally:
        target.keep_hidden = False
    draft = EagleDraft(EagleHead(target.args).init_random(2), copy.deepcopy(target), params, "eagle")
    source, start = eagle_hooks(draft, params, cache_slots=256)
    peer = Replay([prompt_message(0, len(prompt), feats),
                   reply_message(0, 0, done=False, committed=len(prompt) + 1, tokens=[5], features=None)])
    side = Side(None, None, params, peer, RunRecorder(), time.perf_counter, 0,  # type: ignore[arg-type]
                draft_source=source, start_features=start)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="kept no hidden states"):
        draft_worker(side, RealRequest(0, "p", prompt, 8), 1, width=2, budget=4)
    assert [m.kind for m in peer.sent] == [Kind.TREE]


def test_the_target_s_messages_carry_the_feature_bytes_the_simulator_charges() -> None:
    """Prompt features once, then per reply the tokens (int64) and ``features_bytes`` of them:
    the sizes of testbed.links, which the simulator's reply adds (``reply_feature_bytes``)."""
    from sim.schedules.async_tree import reply_feature_bytes

    target = tiny(0, WIDE)
    reqs = _requests(2, 12)
    run = _eagle_run(target, EagleHead(target.args).init_random(2), reqs, depth=2, width=2, budget=4)
    act = target.dtype.itemsize
    prompts = [m for m in run.replies if m.kind == Kind.ACTIVATIONS]
    assert [m.payload_bytes for m in prompts] == [
        features_bytes(len(r.prompt_ids) - 1, hidden=target.args.dim, act_bytes=act) for r in reqs]
    replies = [m for m in run.replies if m.kind in (Kind.VERIFIED, Kind.STOP)]
    assert len(replies) == len(run.rec.frames()[0])
    for m in replies:
        n = m.tensors[0].numel()
        assert m.payload_bytes == 8 * n + features_bytes(n, hidden=target.args.dim, act_bytes=act)
    # the simulator's per-token charge is the same function, at the preset's activation size
    exp = compose_exp("pair=smollm2_135m+smollm2_eagle", "schedule=async", "pair.target.quant=fp32")
    assert reply_feature_bytes(exp) == features_bytes(1, hidden=exp.pair.target.hidden, act_bytes=act)


# ------------------------------------------------- async_rank of both groups, in process
@dataclasses.dataclass
class Ranks:
    target: AsyncServed
    draft: AsyncServed
    sent: list[Message]  # by the target
    rec: RunRecorder  # the target leader's: the run's rounds and requests


def _async_ranks(exp) -> Ranks:  # type: ignore[no-untyped-def]
    """``async_rank`` of each group's one rank on a thread of this process, as the worker
    processes run it (loading, probes, the requests, the ``ar`` baseline), the bridge a
    LoopbackTransport. Unlike two processes, both threads get the one target this process
    loads (real.runtime.loading caches it): the draft's reads of it are its embedding, norm
    and LM head; its features reach the draft only in messages (``Side.start_features`` and
    the replies), never from the shared model."""
    from real.runtime.async_run import async_rank
    from real.runtime.loading import load, model_device
    from real.runtime.worker import WorkerContext
    from testbed.config import real_dtype
    from testbed.placement import BRIDGE, make_placement

    t = exp.pair.target
    load(t.path, "pair.target", model_name=t.name, dtype=real_dtype(exp), device=model_device(exp))  # once
    pl = make_placement(exp, devices=2)
    bridge = next(c for c in pl.channels if c.kind == BRIDGE)
    t0 = time.perf_counter()
    ends = LoopbackTransport.connect(bridge.name, bridge.ranks, recv_timeout_s=120.0,
                                     clock=lambda: time.perf_counter() - t0)
    sent: list[Message] = []
    end = ends[pl.group("target").leader]
    put = end._put
    end._put = lambda msg, dst: (sent.append(msg), put(msg, dst))  # type: ignore[method-assign]
    ctxs = {pl.rank(r).role: WorkerContext(exp, pl, r, torch.device("cpu"), RunRecorder(), t0, 120.0,
                                           transports={bridge.name: ends[r]}) for r in bridge.ranks}
    served: dict[str, AsyncServed] = {}
    errors: list[BaseException] = []

    def rank(role: str) -> None:
        try:
            served[role] = async_rank(ctxs[role])
        except BaseException as e:  # noqa: BLE001 — reported by the test
            errors.append(e)

    thread = threading.Thread(target=rank, args=("draft",))
    thread.start()
    try:
        rank("target")
    finally:
        thread.join(120)
        for end in ends.values():
            end.close()
    assert not errors, errors
    return Ranks(served["target"], served["draft"], sent, ctxs["target"].rec)


@pytest.fixture(scope="module")
def tiny_eagle(tmp_path_factory) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A tiny target checkpoint and a random eagle head for it that proposes from half its
    vocabulary (``TINY_DRAFT_VOCAB`` tokens: every draft path runs restricted)."""
    from real.model.weights import load_model

    root = tmp_path_factory.mktemp("tiny_eagle")
    target_dir = write_tiny_checkpoint(root / "target", seed=1, layers=3)
    target, _ = load_model(target_dir, max_seq=64)
    head = EagleHead(target.args).init_random(3)
    head.set_draft_vocab(torch.arange(0, 2 * TINY_DRAFT_VOCAB, 2), target.args.vocab_size)
    save_head(head, root / "head", target_name="tiny")
    return target_dir, root / "head"


TINY_DRAFT_VOCAB = 24


def _tiny_exp(target: Path, head: Path, *extra: str):  # type: ignore[no-untyped-def]
    return compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", f"pair.target.path={target}",
                       f"pair.draft.path={head}", f"pair.draft.draft_vocab={TINY_DRAFT_VOCAB}",
                       "workload.num_prompts=2", "workload.max_new_tokens=20",
                       "real.ignore_eos=true", "real.progress=false", "schedule=async",
                       "schedule.tree_width=3", "schedule.tree_budget=6", *extra)


def test_async_rank_with_an_eagle_head_equals_its_ar_baseline_in_process(tiny_eagle) -> None:  # type: ignore[no-untyped-def]
    run = _async_ranks(_tiny_exp(*tiny_eagle))
    target, draft = run.target, run.draft
    assert target.outputs == [r["output_ids"] for r in target.baseline.requests]
    assert all(len(o) == 20 for o in target.outputs)
    assert draft.extra["tree_depth_used"] >= 1 and draft.extra["probe_draft_s"] > 0
    assert draft.extra["probe_draft_k8_s"] > 0  # and its tree expansion's size (every node's logits)
    assert target.extra["probe_target_s"] > 0


@pytest.mark.model
def test_bundled_eagle_pair_async_equals_ar_at_temperature_0_in_process() -> None:
    """The shipped head (models/smollm2-eagle) in bf16 (real.dtype=auto), both groups' ranks as
    the worker processes run them; every reply carries the target's bf16 features."""
    exp = compose_exp("backend=real", "schedule=async", "pair=smollm2_135m+smollm2_eagle",
                      "workload.num_prompts=1", "workload.max_new_tokens=16", "real.ignore_eos=true",
                      "real.progress=false")
    assert exp.real.dtype == "bf16"
    run = _async_ranks(exp)
    target, draft, sent = run.target, run.draft, run.sent
    assert target.outputs == [r["output_ids"] for r in target.baseline.requests]
    assert all(len(o) == 16 for o in target.outputs)
    assert draft.extra["tree_depth_used"] >= 1
    rounds = run.rec.frames()[0]
    assert rounds.accepted.sum() > 0 and (rounds.verified_tokens > 1).all()
    # each reply: the tokens and the simulator's charge for their features at bf16 activations
    from sim.schedules.async_tree import reply_feature_bytes

    per_token = reply_feature_bytes(compose_exp("pair=smollm2_135m+smollm2_eagle", "schedule=async",
                                                "pair.target.quant=bf16"))
    replies = [m for m in sent if m.kind in (Kind.VERIFIED, Kind.STOP)]
    assert replies
    for m in replies:
        n = m.tensors[0].numel()
        assert m.tensors[1].dtype == torch.bfloat16
        assert m.payload_bytes == 8 * n + n * per_token == 8 * n + features_bytes(n, hidden=576, act_bytes=2)


# ---------------------------------------------------------------------- two processes
@two_cores
def test_async_with_an_eagle_head_on_two_processes_equals_ar_at_temperature_0(tiny_eagle) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    res = run(_tiny_exp(*tiny_eagle))
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 20 for o in spec) and res.extra["processes"] == 2
    assert res.extra["draft"] == "smollm2_eagle" and res.extra["probe_draft_s"] > 0
    assert live_workers() == []


@two_cores
@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)])  # (a TP tree: test_real_multiprocess)
def test_an_eagle_head_beside_a_tensor_parallel_target_under_load_equals_ar(tiny_eagle, tree: bool) -> None:  # type: ignore[no-untyped-def]
    """The sync chain or the serial tree under load with the target over a TP 2 group: each rank
    runs the whole head (not sharded) on the all-reduced features; every answer is
    single-process `ar`'s (the ranks' outputs are compared in the run)."""
    from real.runtime.engine import run

    common = ("schedule=sync", "workload.num_prompts=3", "workload.max_new_tokens=12")
    alone = run(_tiny_exp(*tiny_eagle, *common, "schedule=ar"))
    two = run(_tiny_exp(*tiny_eagle, *common, "workload.concurrency=3", "placement.target_gpus=2",
                        *(("schedule.tree=true", "schedule.tree_depth=2") if tree else ())))
    assert two.extra["processes"] == 2 and two.extra["draft"] == "smollm2_eagle"
    by_id = {r["request_id"]: r["output_ids"] for r in two.recorder.requests}
    assert by_id == {r["request_id"]: r["output_ids"] for r in alone.recorder.requests}
    assert two.recorder.frames()[2]["batch"].max() > 1
    assert live_workers() == []


def test_eagle_with_async_refuses_a_tensor_parallel_draft_group() -> None:
    from testbed.config import ConfigError

    with pytest.raises(ConfigError, match=r"placement.draft_gpus=2 is not allowed: 1 with an eagle draft"):
        compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", "schedule=async", "placement.draft_gpus=2",
                    "hardware.gpus_per_node=4")


# ------------------------------------------------------------------- under load
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_async_with_an_eagle_head_under_load_answers_each_request_as_served_alone(temperature: float,
                                                                                  monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Requests of different lengths join and leave the batch of trees: the draft group starts
    each request's head row from the target's prompt features and re-roots it on the features
    of every answer, the head's expansions of all trees in one forward; each answer is the one
    the one-request async workers give it (temperature 0: greedy decoding)."""
    from real.model import eagle_tree
    from real.runtime.batching_async import draft_server, target_server
    from testbed.spec.tree_drafter import AsyncDepth

    params = SamplingParams(temperature=temperature)
    target = tiny(0, WIDE)
    head = EagleHead(target.args).init_random(2, std=0.5)
    gen = torch.Generator().manual_seed(8)
    reqs = [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (3 + 4 * (i % 3),), generator=gen).tolist(),
                        6 + 5 * (i % 3)) for i in range(5)]

    def sides(draft_model: Any) -> tuple[Side, Side, list]:  # type: ignore[type-arg]
        ends = LoopbackTransport.connect("bridge", (0, 1), recv_timeout_s=30.0)
        t = Side(target, LocalModel(target), params, Peer(ends[0], ends[0], lambda m: m), RunRecorder(),
                 time.perf_counter, 0, reply_features=True)
        source, start = eagle_hooks(draft_model, params, cache_slots=256)
        d = Side(None, None, params, Peer(ends[1], ends[1], lambda m: m), RunRecorder(), time.perf_counter, 0,
                 draft_source=source, start_features=start)
        return t, d, list(ends.values())

    def reset() -> None:
        target.keep_hidden = False

    target.setup_cache(256)
    t, d, ends = sides(EagleDraft(head, copy.deepcopy(target), params, "eagle"))
    run_both(lambda: [target_worker(t, r, frozenset()) for r in reqs],
             lambda: [draft_worker(d, r, 2, width=3, budget=5) for r in reqs], ends, after=reset)
    alone = [r["output_ids"] for r in sorted(t.rec.requests, key=lambda r: r["request_id"])]

    exp = compose_exp("schedule=async", "schedule.tree_width=3", "schedule.tree_budget=5", "workload.concurrency=3",
                      f"sampling.temperature={temperature}")
    parts: list[int] = []
    batched = eagle_tree.eagle_rows_tree
    t, d, ends = sides(EagleDraft(head, copy.deepcopy(target), params, "eagle"))
    got: list[list[int]] = []
    monkeypatch.setattr(eagle_tree, "eagle_rows_tree", lambda p: parts.append(len(p)) or batched(p))
    run_both(lambda: got.extend(target_server(t, exp, reqs, frozenset(), slots=64)),
             lambda: draft_server(d, exp, reqs, AsyncDepth.constant(2),
                                  eagle=EagleDraft(head, copy.deepcopy(target), params, "eagle")), ends)
    assert got == alone
    if temperature == 0:
        assert alone == [_greedy(target, r.prompt_ids, r.max_new_tokens) for r in reqs]
    assert not target.keep_hidden  # the server hands the target back without its hidden states
    rounds, _, timeline = t.rec.frames()
    verify = timeline[(timeline.resource == "target") & (timeline.kind == "verify")]
    assert verify.batch.max() == 3 and rounds.accepted.sum() > 0 and max(parts) == 3
