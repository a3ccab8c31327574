"""backend=real under load: batched forwards equal batch-1 forwards, every request's output
under continuous batching equals its output served alone (temperature 0: `ar`'s; temperature 1:
its own seeded draws), the batched sampler samples the target's distribution, and the rounds
never exceed serving.max_batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from real.model.batch import CacheRows, Feed, forward_batch
from real.model.decoder import ModelArgs
from real.model.drafts import EarlyExitDraft, ModelDraft, NgramDraft
from real.model.eagle import EagleDraft, EagleHead
from real.model.runners import TargetRunner
from real.runtime.batching import serve_batched
from real.runtime.context import RealContext, RealRequest
from real.schedules.ar import serve_ar
from real.schedules.sync import serve_sync
from specbed_kernels import native
from testbed.config import ConfigError
from testbed.recorder import RunRecorder
from testbed.spec.lookahead import FEATURES
from testbed.spec.sampling import SamplingParams
from tests.conftest import compose_exp, run_cli
from tests.helpers.real_models import (
    TINY,
    TWO_TOKEN_PROMPT,
    TWO_TOKEN_VOCAB,
    exact_two_token_law,
    tiny,
    two_token_pair,
    two_token_tv,
)

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=TINY.vocab_size,
                  rope_theta=10000.0, max_seq_len=64)


def _ctx(exp, target, draft, params) -> RealContext:  # type: ignore[no-untyped-def]
    return RealContext(exp, TargetRunner(target, params), draft, RunRecorder(), frozenset(), params,
                       lambda n: None, 0.0)


def _requests(n: int, *, lengths: bool = True) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(1)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (3 + 4 * (i % 4),), generator=gen).tolist(),
                        8 + 5 * (i % 3) if lengths else 12) for i in range(n)]


def _alone(exp, target, draft, params, serve, reqs) -> list[list[int]]:  # type: ignore[no-untyped-def]
    target.setup_cache(64)
    if isinstance(draft, ModelDraft):
        draft.model.setup_cache(64)
    ctx = _ctx(exp, target, draft, params)
    for r in reqs:
        serve(ctx, r)
    return [r["output_ids"] for r in ctx.rec.requests]


def _batched(exp, target, draft, params, reqs) -> RealContext:  # type: ignore[no-untyped-def]
    ctx = _ctx(exp, target, draft, params)
    serve_batched(ctx, reqs, max_seq=64)
    return ctx


def _by_request(ctx: RealContext) -> list[list[int]]:
    return [r["output_ids"] for r in sorted(ctx.rec.requests, key=lambda r: r["request_id"])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_forward_equals_each_request_alone(dtype: torch.dtype) -> None:
    """Rows of several requests (different lengths, slots, a tree mask) in one forward give each
    request the logits of its own forward: bit for bit on the native path, close op by op."""
    model = tiny(0).to(dtype)
    alone = tiny(0).to(dtype)
    alone.setup_cache(64)
    rows = CacheRows(model, 3, 64)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]
    feeds_tokens = [[11, 12, 13], [5, 6, 7, 8], [40, 41]]
    mask = torch.ones(4, 3 + 4, dtype=torch.bool).tril(diagonal=3)
    mask[3, 5] = False  # a tree: node 3 does not see node 2
    feeds = []
    for p, toks in zip(prompts, feeds_tokens):
        row = rows.acquire()
        rows.prefill(row, p)
        feeds.append(Feed(row, toks, len(p), mask=mask if len(toks) == 4 else None))
    got = forward_batch(model, feeds)
    for p, f, g in zip(prompts, feeds, got):
        alone.truncate(0)
        alone(torch.tensor([p]), input_pos=0)
        want = alone(torch.tensor([f.tokens]), input_pos=len(p), mask=f.mask)[0]
        if native.AVAILABLE:
            assert torch.equal(g, want)
        assert torch.allclose(g, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    if native.AVAILABLE:  # the op-by-op path (off the CPU; the oracle) computes the same
        native.AVAILABLE = False
        try:
            for p, f in zip(prompts, feeds):
                rows.prefill(f.row, p)
            ref = forward_batch(model, feeds)
        finally:
            native.AVAILABLE = True
        for g, r in zip(got, ref):
            assert torch.allclose(g, r, atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


def test_more_rows_than_one_native_call_split_exactly() -> None:
    """A batch over more rows than one native call takes is split into groups, still exact."""
    model = tiny(0)
    rows = CacheRows(model, 24, 64)
    feeds = []
    for i in range(24):
        row = rows.acquire()
        rows.prefill(row, [i % 90 + 1, 3, 4])
        feeds.append(Feed(row, [5, 6, 7 + i % 5], 3))
    got = forward_batch(model, feeds)
    alone = tiny(0)
    alone.setup_cache(64)
    for i, g in enumerate(got):
        alone.truncate(0)
        alone(torch.tensor([[i % 90 + 1, 3, 4]]), input_pos=0)
        want = alone(torch.tensor([feeds[i].tokens]), input_pos=3)[0]
        assert torch.equal(g, want) if native.AVAILABLE else torch.allclose(g, want, atol=1e-5)


@pytest.mark.parametrize("load", [("workload.concurrency=3",), ("workload.arrival=poisson", "workload.rate=400")])
@pytest.mark.parametrize("draft", [None, "model", "early_exit", "ngram"])
def test_temperature_0_outputs_under_batching_equal_ar_alone(load: tuple[str, ...], draft: str | None) -> None:
    """Requests of different prompt and output lengths join and leave the batch; each answer is
    the one `ar` gives it served alone."""
    params = SamplingParams()
    target = tiny(0)
    reqs = _requests(7)
    exp = compose_exp("schedule.gamma=3", *load)
    ar = _alone(exp, target, None, params, serve_ar, reqs)
    d = {"model": ModelDraft(tiny(3, SMALL), params, "tiny"), "ngram": NgramDraft(2, TINY.vocab_size),
         "early_exit": EarlyExitDraft(target, 2, params)}.get(draft)
    ctx = _batched(exp, target, d, params, reqs)
    assert _by_request(ctx) == ar
    _, requests, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() > 1  # requests really shared rounds
    assert (requests.first_token_s >= requests.arrival_s + requests.queue_s).all()
    assert (requests.finish_s >= requests.first_token_s).all()


class _GraphRecorder:
    """Stands in for ``GraphedBatches`` off a GPU: records the feeds offered to the graphs and
    declines them (None: the forward runs eagerly)."""

    def __init__(self) -> None:
        self.offered: list[tuple[int, int]] = []  # (requests, tokens of the longest feed)

    def logits(self, feeds: list[Feed]) -> None:
        self.offered.append((len(feeds), max(len(f.tokens) for f in feeds)))

    def prepare(self, batches: int, counts: list[int]) -> None:
        pass


def test_the_batched_verification_of_a_draft_model_is_offered_to_the_cuda_graphs() -> None:
    """Only an eagle head needs the target's features from a verification; a draft model's
    batched verification goes through ``forward_batch``, whose chains replay CUDA graphs on a GPU
    (when it kept the features it ran eagerly there: 31.5 ms a verification of 4 requests against
    ~2 ms replayed)."""
    params = SamplingParams()
    target = tiny(0)
    reqs = _requests(4, lengths=False)
    exp = compose_exp("schedule.gamma=3", "workload.concurrency=4")
    target.graph_batches = recorder = _GraphRecorder()  # type: ignore[assignment]
    try:
        _batched(exp, target, ModelDraft(tiny(3, SMALL), params, "tiny"), params, reqs)
    finally:
        target.graph_batches = None
    assert (4, 4) in recorder.offered  # four requests' windows of 1 + 3 tokens


def _eagle_alone_and_batched(exp, serve, *, seed: int) -> RealContext:  # type: ignore[no-untyped-def]
    """Six requests of mixed lengths on a 4-token target (a random head's guesses are often
    right) with an eagle head: served alone by ``serve``, then under ``exp``'s load; asserts every
    answer under load is the one served alone (at temperature 0: `ar`'s); the batched run."""
    params = SamplingParams(temperature=exp.sampling.temperature)
    target, _ = two_token_pair(2)
    gen = torch.Generator().manual_seed(seed)
    reqs = [RealRequest(i, f"p{i}", torch.randint(0, TWO_TOKEN_VOCAB, (2 + 3 * (i % 3),), generator=gen).tolist(),
                        8 + 4 * (i % 3)) for i in range(6)]
    head = EagleHead(target.args).init_random(2, std=0.5)
    try:
        alone = _alone(exp, target, EagleDraft(head, target, params, "eagle"), params, serve, reqs)
        ctx = _batched(exp, target, EagleDraft(head, target, params, "eagle"), params, reqs)
    finally:
        target.keep_hidden = False
    assert _by_request(ctx) == alone
    if params.greedy:
        assert alone == _alone(exp, target, None, params, serve_ar, reqs)
    return ctx


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_eagle_head_under_batching_answers_as_served_alone(temperature: float, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each request's head state (its row of the head's cache, the target's features of its
    accepted tokens from the batched verification) gives the draws it gets served alone; at
    temperature 0 that is `ar`'s output. The head's steps of the requests run together."""
    from real.runtime import batching

    steps: list[int] = []
    batched = batching.eagle_rows_logits
    monkeypatch.setattr(batching, "eagle_rows_logits", lambda s: steps.append(len(s)) or batched(s))
    exp = compose_exp("schedule.gamma=3", "workload.concurrency=3", f"sampling.temperature={temperature}")
    ctx = _eagle_alone_and_batched(exp, serve_sync, seed=2)
    rounds, _, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() == 3 and rounds.accepted.sum() > 0  # shared rounds; features handed over
    assert max(steps) == 3  # one head forward for the three requests' step


def test_the_batch_policy_turns_speculation_off_from_a_batch_size_with_ar_s_outputs() -> None:
    """lookahead=batch '1:3 3:0': three guesses alone, none in rounds of three or more; every
    answer is `ar`'s. The draft is the target itself, so every guess is accepted exactly when
    the draft caught up on every token it skipped while speculation was off."""
    params = SamplingParams()
    target = tiny(0)
    reqs = _requests(7)
    exp = compose_exp("schedule.gamma=3", "lookahead=batch", "lookahead.by_batch=1:3 3:0", "workload.concurrency=3")
    ar = _alone(exp, target, None, params, serve_ar, reqs)
    ctx = _batched(exp, target, ModelDraft(tiny(0), params, "itself"), params, reqs)
    assert _by_request(ctx) == ar
    rounds = ctx.rec.frames()[0]
    batch = rounds.groupby("start_s").request_id.transform("size")
    assert (rounds.drafted[batch >= 3] == 0).all() and (rounds.drafted[batch == 1] == 3).all()
    assert (batch >= 3).any() and (batch == 1).any()
    assert (rounds.accepted == rounds.drafted).all() and rounds.accepted.sum() > 0


def test_the_oracle_under_batching_drafts_what_the_target_accepts_with_ar_s_outputs() -> None:
    """lookahead.policy=oracle under load: each request's reference is its greedy continuation,
    generated before serving; a round drafts until the first guess the target rejects and drops
    it, so every guess verified is accepted, and every answer is `ar`'s."""
    params = SamplingParams()
    target, draft = two_token_pair()
    gen = torch.Generator().manual_seed(2)
    reqs = [RealRequest(i, "p", torch.randint(0, TWO_TOKEN_VOCAB, (3 + 2 * (i % 3),), generator=gen).tolist(),
                        8 + 5 * (i % 3)) for i in range(7)]
    exp = compose_exp("schedule.gamma=4", "lookahead.policy=oracle", "workload.concurrency=3")
    ar = _alone(exp, target, None, params, serve_ar, reqs)
    ctx = _batched(exp, target, ModelDraft(draft, params, "two_token"), params, reqs)
    assert _by_request(ctx) == ar
    rounds, _, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() > 1
    assert (rounds.accepted == rounds.checked).all() and rounds.accepted.sum() > 0
    # windows the oracle cut at the first guess the target would reject, others it ran far
    assert (rounds.drafted == 0).any() and (rounds.drafted >= 2).any()


def test_rounds_never_exceed_max_batch_and_queue_waits() -> None:
    params = SamplingParams()
    exp = compose_exp("workload.concurrency=5", "serving.max_batch=2", "schedule.gamma=2")
    ctx = _batched(exp, tiny(0), ModelDraft(tiny(3, SMALL), params, "tiny"), params, _requests(6))
    _, requests, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() == 2
    assert (requests.queue_s > 0).sum() >= 3  # five clients, two rows: three waited


def test_temperature_1_batched_draws_equal_each_request_served_alone() -> None:
    """Each request draws from its own seeded generator in the same order as served alone."""
    params = SamplingParams(temperature=1.0)
    target = tiny(0)
    reqs = _requests(6)
    exp = compose_exp("schedule.gamma=3", "workload.concurrency=4")
    draft = ModelDraft(tiny(3, SMALL), params, "tiny")
    alone = _alone(exp, target, draft, params, serve_sync, reqs)
    ctx = _batched(exp, target, ModelDraft(draft.model, params, "tiny"), params, reqs)
    assert _by_request(ctx) == alone


def test_batched_sync_samples_the_target_distribution_at_temperature_1() -> None:
    """Two-token continuations served 8 at a time: the empirical distribution matches the
    target's exact one within a fixed TV tolerance (the draft is far from the target)."""
    target, draft_model = two_token_pair(1)
    params = SamplingParams(temperature=1.0)
    p_exact, q_exact = exact_two_token_law(target, params), exact_two_token_law(draft_model, params)
    assert 0.5 * (p_exact - q_exact).abs().sum() > 0.25  # the test has power
    n = 2000
    exp = compose_exp("schedule.gamma=3", "seed=5", "workload.concurrency=8")
    ctx = _batched(exp, target, ModelDraft(draft_model, params, "q"), params,
                   [RealRequest(i, "p", TWO_TOKEN_PROMPT, 2) for i in range(n)])
    tv = two_token_tv(ctx.rec.requests, p_exact)
    assert tv < 0.06, tv  # E[TV] of 2000 exact samples over 16 outcomes is ≈ 0.035
    assert ctx.rec.frames()[2]["batch"].max() == 8


@pytest.mark.parametrize(("overrides", "says"), [
    (("schedule=sync", "schedule.tree=true", "pair=smollm2_135m+ngram3"), "pair.draft.kind"),
    (("schedule=async", "placement.target_gpus=2", "hardware.gpus_per_node=3"), "placement.target_gpus"),
    (("schedule=ar", "workload.concurrency=65"), "serving.max_batch=0"),  # 65 KV-cache rows
])
def test_what_the_real_backend_cannot_batch_says_so(overrides: tuple[str, ...], says: str, tmp_path: Path) -> None:
    p = run_cli("backend=real", "workload.concurrency=2", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_trace_sets_each_requests_output_length_and_cycles_the_prompts(tmp_path: Path) -> None:
    from real.model.tokenizer import load_bundled_tokenizer
    from real.runtime.loading import build_requests

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,10,7\n1.0,10,3\n")
    exp = compose_exp("backend=real", "workload.arrival=trace", f"workload.trace_path={trace}",
                      "workload.num_prompts=2")
    reqs = build_requests(exp, load_bundled_tokenizer(), 8192)
    assert [r.max_new_tokens for r in reqs] == [5, 7, 3]
    assert reqs[2].prompt_ids == reqs[0].prompt_ids != reqs[1].prompt_ids  # two prompts, cycled


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_serial_tree_under_batching_answers_as_served_alone(temperature: float) -> None:
    """Trees of requests joining and leaving grow in batched expansions and verify in batched
    forwards; every request's answer equals the one it gets served alone (T=0: `ar`'s)."""
    from real.schedules.sync_tree import serve_sync_tree

    params = SamplingParams(temperature=temperature)
    target = tiny(0)
    reqs = _requests(6)
    exp = compose_exp("schedule=sync", "schedule.tree=true", "schedule.gamma=2", "schedule.tree_width=3",
                      "schedule.tree_budget=5", "workload.concurrency=3", f"sampling.temperature={temperature}")
    draft = ModelDraft(tiny(3, SMALL), params, "tiny")
    alone = _alone(exp, target, draft, params, serve_sync_tree if temperature else serve_ar, reqs)
    ctx = _batched(exp, target, ModelDraft(draft.model, params, "tiny"), params, reqs)
    assert _by_request(ctx) == alone
    rounds, _, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() == 3 and (rounds.verified_tokens <= 5).all() and rounds.accepted.sum() > 0


def test_a_request_larger_than_the_kv_budget_is_refused_before_it_waits_forever() -> None:
    """(the CLI turns the ConfigError into one line and exit 2: tests/sim/test_batching.py)"""
    from real.runtime.engine import serve

    exp = compose_exp("backend=real", "schedule=ar", "workload.concurrency=2", "serving.kv_budget_tokens=20")
    with pytest.raises(ConfigError, match="needs its prompt"):
        serve(exp, "ar", tiny(0), None, requests=_requests(2), eos=frozenset(), progress=False)


def test_trace_runs_under_load_record_the_draft_features_per_token_policies_replay() -> None:
    params = SamplingParams()
    exp = compose_exp("schedule.gamma=3", "workload.concurrency=3", "workload.split=trace")
    ctx = _batched(exp, tiny(0), ModelDraft(tiny(3, SMALL), params, "tiny"), params, _requests(4))
    features = ctx.rec.extra_round_columns["draft_features"]
    assert len(features) == len(ctx.rec.rounds) and all(len(f) == 3 * FEATURES for f in features)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_serial_tree_with_an_eagle_head_under_batching_answers_as_served_alone(temperature: float,
                                                                                  monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An eagle head's trees of requests joining and leaving: their expansions run as one head
    forward over the requests' rows, each request takes the target's features of its accepted
    path from the batched verification; every answer equals the one served alone (T=0: `ar`'s)."""
    from real.model import eagle_tree
    from real.schedules.sync_tree import serve_sync_tree

    parts: list[int] = []
    batched = eagle_tree.eagle_rows_tree
    monkeypatch.setattr(eagle_tree, "eagle_rows_tree", lambda p: parts.append(len(p)) or batched(p))
    exp = compose_exp("schedule=sync", "schedule.tree=true", "schedule.gamma=2", "schedule.tree_width=2",
                      "schedule.tree_budget=4", "workload.concurrency=3", f"sampling.temperature={temperature}")
    ctx = _eagle_alone_and_batched(exp, serve_sync_tree, seed=3)
    rounds, _, timeline = ctx.rec.frames()[:3]
    assert timeline["batch"].max() == 3 and (rounds.verified_tokens <= 4).all() and rounds.accepted.sum() > 0
    assert max(parts) == 3  # one head forward for the three requests' expansion


def test_under_load_the_run_probe_reads_before_and_after_serving_never_between_rounds(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The requests overlap, so a reading between them would delay rounds: one reading before
    serving starts and one after the last answer bracket the run (``probe_points`` 2)."""
    import time

    from real.calibrate.probe_forward import RunProbe
    from real.runtime import batching, engine

    events: list[tuple[str, float]] = []
    served = batching.serve_batched

    def serve_batched(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("start", time.perf_counter()))
        served(*args, **kwargs)
        events.append(("end", time.perf_counter()))

    monkeypatch.setattr(batching, "serve_batched", serve_batched)
    probe = RunProbe({"target": lambda: events.append(("probe", time.perf_counter()))})
    exp = compose_exp("backend=real", "schedule=ar", "workload.concurrency=3")
    target = tiny(0)
    extra: dict = {}
    engine.serve(exp, "ar", target, None, requests=_requests(5), eos=frozenset(), progress=False, extra=extra,
                 probe=probe)
    kinds = [k for k, _ in events]
    first, last = kinds.index("start"), kinds.index("end")
    assert set(kinds[:first]) == {"probe"} and set(kinds[last + 1:]) == {"probe"} and "probe" not in kinds[first:last]
    assert extra["probe_points"] == 2
