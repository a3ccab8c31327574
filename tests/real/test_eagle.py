"""The eagle draft (real/model/eagle.py): lossless in every chain schedule, the target's features handed
over exactly, training that learns, and heads that do not fit refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from real.errors import RealSetupError
from real.model.decoder import Transformer
from real.model.eagle import (
    EagleDraft,
    EagleHead,
    chain_accepted,
    forced_logits,
    load_head,
    save_head,
)
from real.model.runners import TargetRunner
from real.runtime.context import RealContext, RealRequest
from real.schedules.ar import serve_ar
from real.schedules.sync import serve_sync
from real.train.eagle import (
    eagle_loss,
    pack_rows,
    target_features,
    train_head,
    unrolled_predictions,
)
from testbed.config import ConfigError
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from tests.conftest import compose_exp
from tests.helpers.real_models import (
    TINY,
    TWO_TOKEN_PROMPT,
    TWO_TOKEN_VOCAB,
    exact_two_token_law,
    tiny,
    two_token_pair,
    two_token_tv,
)
from tests.helpers.tree_fakes import forced_path


def _ctx(exp, target, draft, params) -> RealContext:  # type: ignore[no-untyped-def]
    return RealContext(exp, TargetRunner(target, params), draft, RunRecorder(), frozenset(), params,
                       lambda n: None, 0.0)


def _serve(ctx: RealContext, serve, requests) -> list[list[int]]:  # type: ignore[no-untyped-def]
    for r in requests:
        serve(ctx, r)
    return [r["output_ids"] for r in ctx.rec.requests]


def _requests(n: int = 3, new: int = 20) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(1)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (4 + 3 * i,), generator=gen).tolist(), new)
            for i in range(n)]


def _copy_target() -> Transformer:
    """A tiny target that copies: tied embeddings of std 1 dominate a residual stream whose layers
    add ~0.02-scale updates, so each token's own logit is the largest and the greedy continuation
    of x is x. (Its features still carry the context through attention: the head must learn
    to read the token input and ignore the rest.)"""
    args = type(TINY)(**{**TINY.__dict__, "tie_embeddings": True})
    target = Transformer(args).init_random(0)
    target.tok_embeddings.weight.data.copy_(torch.randn(target.tok_embeddings.weight.shape,
                                                        generator=torch.Generator().manual_seed(5)))
    target.setup_cache(args.max_seq_len)
    return target


def _eagle_run_and_ar(exp, serve) -> tuple[list[list[int]], list[list[int]], object]:  # type: ignore[no-untyped-def]
    """(the eagle head's outputs with ``serve``, ``ar``'s, the run's rounds) on a tiny target."""
    params = SamplingParams()
    target = tiny(0)
    reqs = _requests()
    ar = _serve(_ctx(exp, target, None, params), serve_ar, reqs)
    target.setup_cache(64)
    draft = EagleDraft(EagleHead(target.args).init_random(2), target, params, "eagle")
    ctx = _ctx(exp, target, draft, params)
    try:
        out = _serve(ctx, serve, reqs)
    finally:
        target.keep_hidden = False
    return out, ar, ctx.rec.frames()[0]


@pytest.mark.parametrize("overrides", [("schedule.gamma=1",), ("schedule.gamma=4",),
                                       ("backend=real", "schedule.gamma=4", "lookahead=confidence"),
                                       ("backend=real", "schedule.gamma=5", "lookahead=heuristic")])
def test_sync_with_an_eagle_head_equals_ar_at_temperature_0(overrides) -> None:  # type: ignore[no-untyped-def]
    out, ar, rounds = _eagle_run_and_ar(compose_exp(*overrides), serve_sync)
    assert out == ar and all(len(o) == 20 for o in out)
    assert (rounds.accepted <= rounds.drafted).all() and (rounds.drafted >= 1).all()


@pytest.mark.parametrize("overrides", [("schedule.tree_width=2", "schedule.tree_budget=4", "schedule.tree_depth=3"),
                                       ("schedule.tree_width=4", "schedule.tree_budget=12", "schedule.tree_depth=4")])
def test_the_serial_tree_with_an_eagle_head_equals_ar_at_temperature_0(overrides) -> None:  # type: ignore[no-untyped-def]
    from real.schedules.sync_tree import serve_sync_tree

    exp = compose_exp("backend=real", "schedule.tree=true", *overrides)
    out, ar, rounds = _eagle_run_and_ar(exp, serve_sync_tree)
    assert out == ar and all(len(o) == 20 for o in out)
    assert (rounds.accepted <= rounds.drafted).all() and (rounds.verified_tokens > 1).all()


def test_the_tree_s_prefix_after_reroots_equals_a_recomputation_from_scratch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """After tree rounds (expand, verify, re-root) that accept drafted tokens, the head's KV of
    the committed pairs equals a fresh head's fed the whole sequence with the target's own
    (causal) features: the pairs drafted on the head's features were fed again."""
    from real.model import tree_tokens
    from real.model.eagle_tree import EagleTreeTokens
    from real.model.tree_tokens import LocalModel, TargetTreeTokens
    from testbed.spec.tree_drafter import TreeDrafter

    monkeypatch.setattr(tree_tokens, "verify_tree", forced_path)

    params = SamplingParams()
    target = tiny(0)
    target.setup_cache(64)
    head = EagleHead(target.args).init_random(4)
    runner = TargetRunner(target, params)
    draft = EagleDraft(head, target, params, "eagle")
    ids = _requests(1)[0].prompt_ids
    try:
        runner.prefill(ids)
        draft.start(ids)
        source = EagleTreeTokens(draft, params, list(ids), cache_slots=128)
        drafter = TreeDrafter(source, width=3, budget=6)
        verifier = TargetTreeTokens(LocalModel(target), params,
                                    features_of=lambda rows: target.last_hidden[0, rows])
        for _ in range(4):
            for _ in range(2):
                drafter.expand()
            drafter.fill()
            res = verifier.verify(drafter.select())
            assert res.accepted == 2
            drafter.advance(res.tokens, features=res.features)
            ids = ids + res.tokens
        drafter.expand()  # feeds the pending prefix pairs with the target's features
        n = len(ids) - 1  # the prefix: pairs 1 .. n-1 (the root, ids[n], is not a pair yet)
        got = [c[:, :, 1:n].clone() for c in (head.body.layers[0].attention.kv_cache.k_cache,
                                                head.body.layers[0].attention.kv_cache.v_cache)]
        fresh_target, fresh_head = copy.deepcopy(tiny(0)), copy.deepcopy(head)
        fresh_target.setup_cache(64)
        feats = fresh_target.forward_layers(fresh_target.embed(torch.tensor([ids[:n]])), 0)
        fresh_head.body.setup_cache(64)
        fresh_head(fresh_target, torch.tensor([ids[1:n]]), feats[:, : n - 1], 1)
        want = [c[:, :, 1:n] for c in (fresh_head.body.layers[0].attention.kv_cache.k_cache,
                                       fresh_head.body.layers[0].attention.kv_cache.v_cache)]
    finally:
        target.keep_hidden = False
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_features_after_a_reroot_equal_a_recomputation_from_scratch() -> None:
    """After rounds of draft/verify/commit the head's next proposal (its cache of real features
    and its drafted ones) equals a fresh head's that started from the whole sequence."""
    params = SamplingParams()
    target, fresh_target = tiny(0), copy.deepcopy(tiny(0))
    head = EagleHead(target.args).init_random(3)
    runner = TargetRunner(target, params)
    draft = EagleDraft(head, target, params, "eagle")
    ids = _requests(1)[0].prompt_ids
    runner.prefill(ids)
    draft.start(ids)
    try:
        for gamma in (3, 1, 4, 2):
            guesses, _ = draft.propose(ids, gamma, None)
            p = runner.probs([ids[-1], *guesses], len(ids) - 1)
            # accept a prefix of the guesses that the target would not (forces a re-root)
            accepted = min(len(guesses) - 1, 1)
            ids = ids + guesses[:accepted] + [int(p[accepted].argmax())]
            draft.commit(ids, accepted, len(guesses))
        guesses, q = draft.propose(ids, 4, None)
        fresh = EagleDraft(copy.deepcopy(head), fresh_target, params, "eagle")
        TargetRunner(fresh_target, params).prefill(ids)
        fresh.start(ids)
        fresh_guesses, fresh_q = fresh.propose(ids, 4, None)
    finally:
        target.keep_hidden = fresh_target.keep_hidden = False
    assert guesses == fresh_guesses
    torch.testing.assert_close(q, fresh_q, atol=1e-5, rtol=1e-4)


def test_unrolled_training_steps_are_the_chain_drafts_guesses() -> None:
    """Training-time test: step i of the unrolled training forward at pair p is what the head
    computes, with its KV cache, for its (i+1)-th guess of a chain that read the target's true
    features up to pair p-i and then its own predictions -- for every step and pair."""
    target = tiny(0)
    head = EagleHead(target.args).init_random(3, std=0.2)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (13,), generator=gen).tolist()
    toks, feats = target_features(target, [ids], 13)[0]
    toks, f_in = toks[1:].long()[None], feats[:-1].float()[None]
    n, steps = toks.shape[1], 3
    with torch.no_grad():
        unrolled = list(unrolled_predictions(head, target, toks, f_in, steps))
        for i in range(steps):
            for p in range(i, n):
                head.body.setup_cache(n + 2, 1)
                out = head.body.forward_layers(head.inputs(target, toks[:, : p - i + 1], f_in[:, : p - i + 1]), 0)
                for j in range(p - i + 1, p + 1):
                    out = head.body.forward_layers(head.inputs(target, toks[:, j : j + 1], out[:, -1:]), j)
                torch.testing.assert_close(unrolled[i][0, p], out[0, -1], atol=2e-5, rtol=1e-4,
                                           msg=f"step {i}, pair {p}")
    # the unrolled steps differ from the first: each reads its own predictions
    assert not torch.allclose(unrolled[0][0, 2:], unrolled[2][0, 2:], atol=1e-3)


def test_training_on_a_tiny_target_learns_its_copy_behaviour() -> None:
    """Teacher-forced random documents; the trained head agrees with the target's next token far
    more often than the untrained one (fixed seeds), and sync then accepts most guesses."""
    torch.manual_seed(0)
    target = _copy_target()
    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, TINY.vocab_size, (48,), generator=gen).tolist() for _ in range(40)]
    rows = pack_rows(target_features(target, docs, 48), 32, seed=0)
    head = EagleHead(target.args).init_random(0)
    with torch.no_grad():
        _, before = eagle_loss(head, target, rows[0][:16], rows[1][:16], noise=0.0, feature_weight=1.0)
    train_head(head, target, rows, steps=80, batch_rows=8, lr=1e-2, seed=0, noise=0.05)
    with torch.no_grad():
        _, after = eagle_loss(head, target, rows[0][:16], rows[1][:16], noise=0.0, feature_weight=1.0)
    assert before < 0.5 and after > 0.95, (before, after)
    exp = compose_exp("schedule.gamma=4")
    params = SamplingParams()
    draft = EagleDraft(head, target, params, "eagle")
    ctx = _ctx(exp, target, draft, params)
    try:
        out = _serve(ctx, serve_sync, _requests(2, 24))
    finally:
        target.keep_hidden = False
    rounds = ctx.rec.frames()[0]
    ar = _serve(_ctx(exp, target, None, params), serve_ar, _requests(2, 24))
    assert out == ar
    assert rounds.accepted.sum() / rounds.drafted.sum() > 0.8
    # real.eval_draft's measures of a head: one step from true features, chains on its own
    req = _requests(2, 24)[1]
    seq = req.prompt_ids + ar[1]
    n = len(req.prompt_ids)
    forced = forced_logits(head, target, seq, n).argmax(-1)
    assert (forced == torch.tensor(seq[n:])).float().mean() > 0.9
    accepted = chain_accepted(head, target, seq, n_prompt=n, gamma=4)
    assert len(accepted) >= 4 and sum(accepted) / len(accepted) > 3.0


def test_features_computed_in_threads_equal_those_computed_one_by_one() -> None:
    """Training computes the target's features of its documents in ``threads`` threads: the same
    features in the same order, documents too short to train on dropped alike."""
    target = tiny(0)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (2, 40, 17, 33, 1, 60)]
    intra = torch.get_num_threads()
    one = target_features(target, docs, 48)
    two = target_features(target, docs, 48, threads=2)
    assert len(one) == len(two) == 4 and torch.get_num_threads() == intra  # restored
    for (t1, f1), (t2, f2) in zip(one, two):
        assert torch.equal(t1, t2) and torch.equal(f1, f2)


def test_a_head_for_another_target_and_a_corrupt_head_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tiny(0)
    other = Transformer(type(TINY)(**{**TINY.__dict__, "dim": 32, "n_heads": 2, "n_kv_heads": 1})).init_random(0)
    save_head(EagleHead(other.args).init_random(0), tmp_path / "other", target_name="other")
    with pytest.raises(RealSetupError, match="another target"):
        load_head(tmp_path / "other", target)
    save_head(EagleHead(target.args).init_random(0), tmp_path / "ok", target_name="tiny")
    torch.testing.assert_close(load_head(tmp_path / "ok", target).fc_weight,
                               EagleHead(target.args).init_random(0).fc_weight)
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"xx")
    with pytest.raises(RealSetupError, match="not a readable eagle head"):
        load_head(tmp_path / "ok", target)


def test_a_draft_vocabulary_computes_only_its_rows_of_the_lm_head() -> None:
    """Restricted to a few tokens, the head's logits are the full head's on those tokens (the same
    sums) and -inf elsewhere."""
    from specbed_kernels import native

    target = tiny(0)
    head = EagleHead(target.args).init_random(2)
    f = torch.randn(1, 3, target.args.dim, generator=torch.Generator().manual_seed(0))
    full = head.logits(target, f)
    assert torch.equal(full, target.head(f))
    ids = torch.tensor([7, 1, 30, 12])
    head.set_draft_vocab(ids, target.args.vocab_size)
    part = head.logits(target, f)
    keep = torch.zeros(target.args.vocab_size, dtype=torch.bool)
    keep[ids] = True
    assert torch.isneginf(part[..., ~keep]).all()
    if native.AVAILABLE:
        assert torch.equal(part[..., keep], full[..., keep])
    else:
        torch.testing.assert_close(part[..., keep], full[..., keep])
    for bad in ([1, 1], [target.args.vocab_size], []):
        with pytest.raises(ValueError, match="distinct token ids"):
            head.set_draft_vocab(torch.tensor(bad, dtype=torch.long), target.args.vocab_size)


def test_a_draft_vocabulary_under_tensor_parallelism_sums_only_its_rows() -> None:
    """Each TP rank computes the draft vocabulary's rows among its own LM-head rows and the ranks
    sum a vector of the draft vocabulary's size, not the whole vocabulary's: the logits equal the
    unsharded head's, on every rank, one all-reduce per call (the ranks stay matched), also where
    a rank holds none of the draft vocabulary's rows."""
    import threading

    from real.model.tp import apply_tp

    world, calls, sizes = 2, [0, 0], []
    parts: list[torch.Tensor | None] = [None] * world
    barrier = threading.Barrier(world)

    class ThreadSum:  # kernels.allreduce.AllReduce over threads of one process
        def __init__(self, rank: int) -> None:
            self.rank, self.world = rank, world

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls[self.rank] += 1
            sizes.append(x.shape[-1])
            parts[self.rank] = x.clone()
            barrier.wait(30)
            total = sum(p for p in parts if p is not None)
            barrier.wait(30)
            return x.copy_(total)

        def native(self) -> None:
            return None

        def error(self, rc: int) -> Exception:
            return RuntimeError(rc)

    def rank_logits(head: EagleHead, shard: Transformer, f: torch.Tensor, out: list, r: int) -> None:
        out[r] = head.logits(shard, f)
        out[r] = head.logits(shard, f)  # the cached rows of this shard serve again

    f = torch.randn(1, 3, TINY.dim, generator=torch.Generator().manual_seed(0))
    for ids, both in ((torch.tensor([7, 1, 30, 12, 90]), True), (torch.tensor([2, 5, 11]), False)):
        whole = tiny(0)
        head = EagleHead(whole.args).init_random(2)
        head.set_draft_vocab(ids, whole.args.vocab_size)
        expected = head.logits(whole, f)
        shards = [apply_tp(tiny(0), rank=r, world=world, allreduce=ThreadSum(r)) for r in range(world)]
        lo1 = shards[1].tp_vocab[0] if shards[1].tp_vocab else 0
        assert bool((ids >= lo1).any()) == both  # the second set lies in rank 0's rows only
        out: list[torch.Tensor | None] = [None] * world
        calls[:], sizes[:] = [0, 0], []

        threads = [threading.Thread(target=rank_logits, args=(head, shards[r], f, out, r)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert calls == [2, 2] and set(sizes) == {ids.numel()}
        for r in range(world):
            torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)
            assert torch.isneginf(out[r]).sum() == expected.numel() - 3 * ids.numel()


@pytest.mark.parametrize("serve_name", ["sync", "tree"])
def test_a_head_with_a_draft_vocabulary_proposes_only_it_and_equals_ar_at_temperature_0(serve_name: str) -> None:
    from real.schedules.sync_tree import serve_sync_tree

    params = SamplingParams()
    target = tiny(0)
    reqs = _requests()
    exp = compose_exp("backend=real", "schedule.gamma=3",
                      *(("schedule.tree=true", "schedule.tree_width=2", "schedule.tree_budget=6") if serve_name == "tree" else ()))
    ar = _serve(_ctx(exp, target, None, params), serve_ar, reqs)
    target.setup_cache(64)
    # half the vocabulary, the tokens `ar` emits among them: some guesses can be right
    emitted = sorted({t for o in ar for t in o})
    ids = sorted(set(emitted[: len(emitted) // 2]) | set(range(0, target.args.vocab_size, 2)))
    head = EagleHead(target.args).init_random(2)
    head.set_draft_vocab(torch.tensor(ids), target.args.vocab_size)
    draft = EagleDraft(head, target, params, "eagle")
    proposed: list[int] = []
    original = EagleDraft.propose

    def spy(self, *a, **kw):  # type: ignore[no-untyped-def]
        guesses, q = original(self, *a, **kw)
        proposed.extend(guesses)
        return guesses, q
    EagleDraft.propose = spy  # type: ignore[method-assign]
    try:
        out = _serve(_ctx(exp, target, draft, params), serve_sync_tree if serve_name == "tree" else serve_sync, reqs)
    finally:
        EagleDraft.propose = original  # type: ignore[method-assign]
        target.keep_hidden = False
    assert out == ar
    if serve_name == "sync":
        assert proposed and set(proposed) <= set(ids)


def test_a_head_with_a_draft_vocabulary_samples_the_target_distribution_at_temperature_1() -> None:
    """The head may propose tokens 0 and 2 only (q is 0 on 1 and 3): two-token continuations
    still follow the target's exact law within a fixed TV tolerance."""
    target, _ = two_token_pair(1)
    params = SamplingParams(temperature=1.0)
    p_exact = exact_two_token_law(target, params)
    assert float(p_exact[[1, 3]].sum()) > 0.25  # the tokens the head cannot propose matter
    head = EagleHead(target.args).init_random(3, std=0.5)
    head.set_draft_vocab(torch.tensor([0, 2]), TWO_TOKEN_VOCAB)
    exp = compose_exp("schedule.gamma=2", "seed=5", "sampling.temperature=1.0")
    target.setup_cache(16)
    ctx = _ctx(exp, target, EagleDraft(head, target, params, "eagle"), params)
    try:
        _serve(ctx, serve_sync, [RealRequest(i, "p", TWO_TOKEN_PROMPT, 2) for i in range(1000)])
    finally:
        target.keep_hidden = False
    tv = two_token_tv(ctx.rec.requests, p_exact)
    assert tv < 0.08, tv  # E[TV] of 1000 exact samples over 16 outcomes is ~0.05
    assert ctx.rec.frames()[0].accepted.sum() > 0


def test_a_draft_vocabulary_is_saved_with_the_head_and_a_corrupt_one_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tiny(0)
    head = EagleHead(target.args).init_random(0)
    head.set_draft_vocab(torch.tensor([3, 9, 2]), target.args.vocab_size)
    save_head(head, tmp_path / "h", target_name="tiny")
    loaded = load_head(tmp_path / "h", target)
    assert loaded.draft_vocab is not None and loaded.draft_vocab.tolist() == [2, 3, 9]
    save_head(EagleHead(target.args).init_random(0), tmp_path / "full", target_name="tiny")
    assert load_head(tmp_path / "full", target).draft_vocab is None
    (tmp_path / "h" / "draft_vocab.safetensors").write_bytes(b"xx")
    with pytest.raises(RealSetupError, match="draft_vocab.safetensors is not a draft vocabulary"):
        load_head(tmp_path / "h", target)


def test_eagle_configs_are_checked() -> None:
    exp = compose_exp("pair=smollm2_135m+smollm2_eagle")
    assert exp.pair.draft.kind == "eagle"
    with pytest.raises(ConfigError, match="pair.draft.hidden"):
        compose_exp("pair=smollm2_135m+smollm2_eagle", "pair.draft.hidden=512")
    for schedule in ("async", "decentralized"):  # every schedule takes the head on both backends
        exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", f"schedule={schedule}")
        assert exp.pair.draft.kind == "eagle"
    assert compose_exp("backend=real", "pair=smollm2_135m+smollm2_eagle", "schedule.tree=true").schedule.tree


def test_the_simulator_costs_an_eagle_head_as_one_layer_an_fc_and_the_lm_head() -> None:
    import dataclasses

    from sim.cost.quant import spec, weight_bytes
    from sim.cost.roofline import RooflineCost
    from sim.cost.roofline_forward import forward_cost

    exp = compose_exp("pair=llama3_8b+llama3_8b_eagle")
    t, d, hw = exp.pair.target, exp.pair.draft, exp.hardware
    head = forward_cost(d, hw, tp=1, tokens=4, context=512)
    one_layer = forward_cost(dataclasses.replace(t, layers=1), hw, tp=1, tokens=4, context=512)
    # the same layer, embedding and LM head as a one-layer target, plus the fc over [embedding, feature]
    fc = weight_bytes(d.quant, 2 * d.hidden, d.hidden) + spec(d.quant).act_bytes * 4 * 3 * d.hidden
    assert head.hbm_bytes - one_layer.hbm_bytes == pytest.approx(fc)
    assert head.flops - one_layer.flops == pytest.approx(2 * 4 * 2 * d.hidden * d.hidden)
    # Llama-3's 128k-row LM head is most of the head's cost: c ~ 0.2 on an H800
    assert head.total_s < forward_cost(t, hw, tp=1, tokens=4, context=512).total_s / 4
    # beside the target in sync: on the target's GPUs, whatever placement.draft_gpus says
    cost = RooflineCost(compose_exp("pair=llama3_8b+llama3_8b_eagle", "placement.target_gpus=2"))
    assert cost.models["draft"][1] == 2


def test_a_draft_vocabulary_is_a_setting_the_simulator_prices_and_the_real_backend_checks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sim.cost.roofline_forward import forward_cost

    exp = compose_exp("pair=llama3_8b+llama3_8b_eagle")
    d, hw = exp.pair.draft, exp.hardware
    small = compose_exp("pair=llama3_8b+llama3_8b_eagle", "pair.draft.draft_vocab=32768").pair.draft
    full_cost, small_cost = (forward_cost(m, hw, tp=1, tokens=1, context=512) for m in (d, small))
    # the LM head's rows: 128,256 -> 32,768 of 4,096 bf16 weights
    assert full_cost.hbm_bytes - small_cost.hbm_bytes == pytest.approx(2 * 4096 * (128256 - 32768), rel=0.01)
    for bad in ("pair.draft.draft_vocab=-1", "pair.draft.draft_vocab=200000"):
        with pytest.raises(ConfigError, match="pair.draft.draft_vocab"):
            compose_exp("pair=llama3_8b+llama3_8b_eagle", bad)
    with pytest.raises(ConfigError, match="an eagle head's"):
        compose_exp("pair.draft.draft_vocab=100")  # the small draft model has its own LM head
    # real: the folder must hold what the setting says, or the setting is 0 (every token)
    target = tiny(0)
    head = EagleHead(target.args).init_random(0)
    save_head(head, tmp_path / "full", target_name="tiny")
    with pytest.raises(RealSetupError, match="has no draft_vocab.safetensors"):
        load_head(tmp_path / "full", target, draft_vocab=8)
    head.set_draft_vocab(torch.arange(10), target.args.vocab_size)
    save_head(head, tmp_path / "ten", target_name="tiny")
    with pytest.raises(RealSetupError, match="holds 10 tokens"):
        load_head(tmp_path / "ten", target, draft_vocab=8)
    assert load_head(tmp_path / "ten", target, draft_vocab=10).draft_vocab is not None
    assert load_head(tmp_path / "ten", target, draft_vocab=0).draft_vocab is None


def test_the_target_reply_carries_the_features_an_eagle_draft_reads() -> None:
    from sim.schedules.async_tree import reply_feature_bytes

    eagle = compose_exp("pair=llama3_70b+llama3_70b_eagle", "schedule=async")
    assert reply_feature_bytes(eagle) == eagle.pair.target.hidden * 2  # bf16 features
    assert reply_feature_bytes(compose_exp("pair=llama3_70b+llama3_2_3b", "schedule=async")) == 0
