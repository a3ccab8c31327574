"""backend=real token trees (serial tree, SwiftSpec-base): temperature 0 is `ar` token for token,
temperature 1 samples the target's distribution, and the draft's KV cache after re-roots is what
a from-scratch computation of the kept nodes gives."""

from __future__ import annotations

import pytest
import torch

from real.model.decoder import Transformer
from real.model.drafts import ModelDraft
from real.model.tree_tokens import DraftTreeTokens, LocalModel
from real.runtime.context import RealRequest
from real.schedules.ar import serve_ar
from real.schedules.sync_tree import serve_sync_tree
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import TreeDrafter
from tests.conftest import compose_exp
from tests.helpers.real_models import (
    TINY,
    TWO_TOKEN_PROMPT,
    exact_two_token_law,
    tiny,
    two_token_pair,
    two_token_tv,
)
from tests.real.test_real_engine import _ctx, _outputs


def _requests(n: int, new_tokens: int) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(7)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (4 + 3 * i,), generator=gen).tolist(),
                        new_tokens) for i in range(n)]


def _draft_like(target: Transformer, noise: float, seed: int) -> Transformer:
    """A draft with the target's architecture and perturbed weights: it agrees often, not always."""
    draft = Transformer(target.args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (_, p), (_, q) in zip(target.named_parameters(), draft.named_parameters()):
            q.copy_(p + noise * torch.randn(p.shape, generator=gen) * p.std().clamp_min(1e-3))
    draft.setup_cache(256)
    return draft


@pytest.mark.parametrize(("width", "budget", "depth"), [(1, 4, 3), (2, 4, 2), (3, 8, 1), (4, 12, 3)])
@pytest.mark.parametrize("noise", [0.0, 0.6])
def test_serial_tree_equals_ar_at_temperature_0(width: int, budget: int, depth: int, noise: float) -> None:
    exp = compose_exp("schedule.tree=true", f"schedule.tree_width={width}",
                      f"schedule.tree_budget={budget}", f"schedule.tree_depth={depth}")
    params = SamplingParams()
    target = tiny(0)
    target.setup_cache(256)
    reqs = _requests(3, 30)
    ar = _outputs(_ctx(exp, target, None, params), serve_ar, reqs)
    ctx = _ctx(exp, target, ModelDraft(_draft_like(target, noise, 1), params, "d"), params)
    tree = _outputs(ctx, serve_sync_tree, reqs)
    assert tree == ar and all(len(o) == 30 for o in tree)
    rounds = ctx.rec.frames()[0]
    assert (rounds.verified_tokens <= budget).all() and (rounds.accepted <= rounds.drafted).all()
    if noise == 0.0:  # an identical draft: every greedy path is accepted as deep as the tree goes
        assert rounds.accepted.mean() > 1.0
    else:
        assert 0 < rounds.accepted.sum() < rounds.drafted.sum()


def test_serial_tree_samples_the_target_distribution_at_temperature_1() -> None:
    """Two-token continuations of a fixed prompt under trees that branch (w=2, bs=5): the
    empirical distribution matches the exact target distribution within a fixed TV tolerance."""
    target, draft_model = two_token_pair(1)
    params = SamplingParams(temperature=1.0)
    prompt = TWO_TOKEN_PROMPT
    p_exact = exact_two_token_law(target, params)
    exp = compose_exp("schedule.tree=true", "schedule.tree_width=2", "schedule.tree_budget=5",
                      "schedule.tree_depth=2", "seed=3")
    ctx = _ctx(exp, target, ModelDraft(draft_model, params, "q"), params)
    n = 3000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops on [5, 4] tensors: waking a thread pool costs more than they do
    try:
        for i in range(n):
            serve_sync_tree(ctx, RealRequest(i, "p", prompt, 2))
    finally:
        torch.set_num_threads(threads)
    tv = two_token_tv(ctx.rec.requests, p_exact)
    assert tv < 0.05, tv  # E[TV] of 3000 exact samples over 16 outcomes is ≈ 0.03
    rounds = ctx.rec.frames()[0]
    assert 0 < rounds.accepted.mean() < 2


@pytest.mark.parametrize("seed", range(6))
def test_draft_cache_after_reroots_equals_a_recomputation(seed: int) -> None:
    """Grow, re-root on random verified tokens (sometimes down the tree, sometimes off it), and
    compare every kept tree slot and every computed prefix slot of the draft's KV cache with a
    from-scratch forward over the same tokens at the same positions."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny(5)
    model.setup_cache(256)
    params = SamplingParams()
    prompt = torch.randint(0, TINY.vocab_size, (6,), generator=gen).tolist()
    with torch.inference_mode():
        model.truncate(0)
        model(torch.tensor([prompt[:-1]]), input_pos=0)
    toks = DraftTreeTokens(LocalModel(model), params, list(prompt))
    drafter = TreeDrafter(toks, width=3, budget=4)
    tree = drafter.tree
    for _ in range(4):
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            drafter.expand()
        # verified tokens: walk down the tree for a random depth, then a random token
        node, verified = 0, []
        for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):
            if not tree.children[node]:
                break
            node = tree.children[node][int(torch.randint(0, len(tree.children[node]), (1,), generator=gen))]
            verified.append(tree.tokens[node])
        verified.append(int(torch.randint(0, TINY.vocab_size, (1,), generator=gen)))
        drafter.advance(verified)
    drafter.expand()  # feeds the pending prefix tokens too
    ref = tiny(5)
    ref.setup_cache(256)
    history = toks.history()
    with torch.inference_mode():
        ref.truncate(0)
        ref(torch.tensor([history[:-1]]), input_pos=0)  # the prefix, causally
    for layer, ref_layer in zip(model.layers, ref.layers):
        k, k_ref = layer.attention.kv_cache.k_cache, ref_layer.attention.kv_cache.k_cache
        assert torch.allclose(k[:, :, : tree.prefix_len], k_ref[:, :, : tree.prefix_len], atol=1e-5)
    # every expanded tree node: its slot equals a forward of prefix + path at its position
    for node in range(len(tree.tokens)):
        slot = tree.slots[node]
        if slot < 0:
            continue
        path = [tree.tokens[n] for n in tree.path(node)]
        with torch.inference_mode():
            ref.truncate(0)
            ref(torch.tensor([history[:-1] + path]), input_pos=0)
        pos = tree.prefix_len + len(path) - 1
        for layer, ref_layer in zip(model.layers, ref.layers):
            got = layer.attention.kv_cache.k_cache[:, :, tree.prefix_len + slot]
            assert torch.allclose(got, ref_layer.attention.kv_cache.k_cache[:, :, pos], atol=1e-5)
            got_v = layer.attention.kv_cache.v_cache[:, :, tree.prefix_len + slot]
            assert torch.allclose(got_v, ref_layer.attention.kv_cache.v_cache[:, :, pos], atol=1e-5)


# ----------------------------------------------------------------------- the bundled model
@pytest.mark.model
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_serial_tree_equals_ar_on_the_bundled_pair(tp: int) -> None:
    """SmolLM2-135M + the trained draft, HumanEval and MT-bench prompts, temperature 0: the serial
    tree is `ar` token for token, in one process and tensor parallel over two."""
    import os

    from real.runtime.engine import run

    if tp > len(os.sched_getaffinity(0)):
        pytest.skip(f"TP={tp} needs {tp} cores")
    for wl in ("humaneval", "mtbench"):
        result = run(compose_exp(
            "backend=real", f"workload={wl}", "workload.num_prompts=2", "workload.max_new_tokens=24",
            "real.progress=false", "real.ignore_eos=true", "schedule.tree=true",
            "schedule.tree_width=4", "schedule.tree_budget=8", "schedule.tree_depth=2",
            f"placement.target_gpus={tp}", f"placement.draft_gpus={tp}"))
        tree = [r["output_ids"] for r in result.recorder.requests]
        assert tree == [r["output_ids"] for r in result.baseline.requests]
        assert all(len(o) == 24 for o in tree)
        assert result.recorder.frames()[0].accepted.sum() > 0
