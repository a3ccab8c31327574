"""specbed_kernels.native (specbed_kernels/native.cpp): the packed GEMM and SwiGLU kernels against F.linear for
every token count of a verification (1-16) and prefill lengths, odd sizes (not multiples of the
vector width), and the fused decoder layers against the op-by-op reference path of real.model.decoder,
including masks (trees), separate RoPE positions, a bf16 KV cache, layer ranges and weights
changed in place (their packed copies must follow). No timings here (benchmarks/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specbed_kernels as kernels
from real.model.decoder import ModelArgs, Transformer
from specbed_kernels import native

pytestmark = [pytest.mark.skipif(not native.AVAILABLE, reason="native kernels not built (no C++ compiler?)"),
              pytest.mark.torch_threads]  # torch's default threads: the kernels' multi-threaded split

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97, max_seq_len=64)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("t", [1, 3, 8, 16])
def test_linear_and_swiglu_match_f_linear(t: int) -> None:
    # K = 70 is not a multiple of the 16/32-element vectors: exercises the masked tails
    x, w = torch.randn(1, t, 70, generator=gen(0)), torch.randn(45, 70, generator=gen(1))
    r = torch.randn(1, t, 45, generator=gen(2))
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.linear_add(x, w, r), F.linear(x, w) + r, atol=1e-5, rtol=1e-5)
    gate_up = w[:44]
    expected = F.silu(F.linear(x, gate_up[:22])) * F.linear(x, gate_up[22:])
    torch.testing.assert_close(native.swiglu_fused(x, gate_up), expected, atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = native.linear(xb, wb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(xb.float(), wb.float()), atol=0.1, rtol=0.01)


@pytest.mark.parametrize("k", [1, 5, 8, 24, 45, 50, 100, 257])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16])
def test_linear_row_lengths(t: int, k: int) -> None:
    # Every register-tile height (1-6 rows on AVX2, 1-12 on AVX-512, and the blocks of 16 rows),
    # inner lengths around the K chunks and K pairs (odd K), output features around the 16/32-wide
    # panels (19: a partial panel) -- the zero padding of packed weights and activations.
    x, w = torch.randn(1, t, k, generator=gen(7)), torch.randn(19, k, generator=gen(8))
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    # bf16 products are exact and summed in fp32: only the summation order and the output rounding
    expected = F.linear(xb.float(), wb.float())
    torch.testing.assert_close(native.linear(xb, wb).float(), expected, atol=1e-3, rtol=2 ** -8)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -8)])
def test_swiglu_exp_range(dtype: torch.dtype, rtol: float) -> None:
    # K = 1 and x = 1: the gates are the weights themselves, so silu (the vectorised exp of -g)
    # is checked from -1e6 to 1e6, including |g| past the range reduction's clamps.
    gates = torch.cat([torch.linspace(-87, 87, 1001),
                       torch.tensor([-1e6, -1e4, -200., -104., -100., -88.8, 88.8, 100., 104., 200., 1e4, 1e6])])
    gate_up = torch.cat([gates, torch.linspace(0.5, 2, gates.numel())])[:, None].to(dtype)
    x = torch.ones(1, 1, 1, dtype=dtype)
    got = native.swiglu_fused(x, gate_up).float()
    g, u = gate_up.float()[:, 0].chunk(2)
    expected = F.silu(g) * u
    assert torch.isfinite(got).all()
    # below g = -88.7 the kernel clamps exp(-g) to exp(88.7): |silu| ~ |g| * 3e-39 instead of ~0
    torch.testing.assert_close(got.flatten(), expected, atol=1e-30, rtol=rtol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_prefill_rows_and_batches(dtype: torch.dtype, tol: float) -> None:
    # more rows than one fused call takes (64), and a batch dimension: the GEMM's row blocks
    x, w = torch.randn(2, 75, 64, generator=gen(3)).to(dtype), torch.randn(40, 64, generator=gen(4)).to(dtype)
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(native.linear(x, w).float(), expected, atol=tol * expected.abs().max().item(), rtol=0)
    gate, up = expected.chunk(2, dim=-1)
    torch.testing.assert_close(native.swiglu_fused(x, w).float(), F.silu(gate) * up,
                               atol=tol * expected.abs().max().item(), rtol=tol)


def test_packed_copy_follows_in_place_updates() -> None:
    # the kernels multiply a packed copy: a weight changed in place must be packed again
    x, w = torch.randn(1, 4, 33, generator=gen(9)), torch.randn(21, 33, generator=gen(10))
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("huge", [True, False])
def test_packed_panels_from_arenas_are_aligned_and_disjoint(huge: bool, monkeypatch) -> None:
    # panels share huge-page arenas: each must be 64-byte aligned (the kernels' vector loads) and
    # none may overlap another, whatever the sizes (a large one gets an arena of its own)
    monkeypatch.setattr(native, "HUGE_PAGES", huge)
    monkeypatch.setattr(native, "ARENA_BYTES", 1 << 20)
    monkeypatch.setattr(native, "_arena", [])
    shapes = [(21, 33), (8, 8), (300, 257), (1, 5), (40, 64)]
    weights = [torch.randn(n, k, generator=gen(i)) for i, (n, k) in enumerate(shapes)]
    packs = [native.packed(w) for w in weights]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in packs)
    assert all(p.data_ptr() % 64 == 0 for p in packs)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    x = torch.randn(3, 257, generator=gen(7))
    torch.testing.assert_close(native.linear(x, weights[2]), F.linear(x, weights[2]), atol=1e-4, rtol=1e-4)
def run_both(model: Transformer, steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``steps`` (callables of the model) op by op and fused, from the same empty cache."""
    outs = []
    for fused in (False, True):
        kernels.reset()
        if not fused:
            kernels.register("decode_layers", kernels.reference.decode_layers)
        model.setup_cache(48)
        with torch.inference_mode():
            outs.append([step(model) for step in steps])
    kernels.reset()
    return list(zip(*outs))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_decode_layers_match_op_by_op(dtype: torch.dtype, tol: float) -> None:
    model = Transformer(ARGS, dtype=dtype).init_random(0, std=0.1).eval()
    # 20 cached slots: attention spans more than one 16-key block of the native kernel
    prompt = torch.randint(0, ARGS.vocab_size, (1, 20), generator=gen(5))
    tree_mask = torch.ones(3, 24, dtype=torch.bool)
    tree_mask[2, 22] = False  # node 2 is a sibling of node 1, not its child
    # 16 nodes, node i's parent (i - 1) // 2 (a binary tree): ancestors and itself visible
    wide_tree = torch.zeros(16, 37, dtype=torch.bool)
    wide_tree[:, :21] = True
    depths = torch.zeros(16, dtype=torch.long)
    for i in range(16):
        node = i
        while True:
            wide_tree[i, 21 + node] = True
            if node == 0:
                break
            node = (node - 1) // 2
            depths[i] += 1
    depths += 21
    steps = [
        lambda m: m(prompt, 0),  # prefill, 20 tokens: op by op in both runs
        lambda m: m(torch.tensor([[7]])),  # decode
        lambda m: m(torch.tensor([[1, 2, 3]]), 21),  # verification, causal
        lambda m: m(torch.tensor([[4, 5, 6]]), torch.tensor([21, 22, 23]), mask=tree_mask,
                    position_ids=torch.tensor([21, 22, 22])),  # a tree
        lambda m: m(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 21),  # 8 tokens
        lambda m: m(torch.arange(1, 13)[None], 21),  # 12 tokens: two full AVX2 tiles
        lambda m: m(torch.arange(1, 17)[None], 21),  # 16 tokens: the longest verification
        lambda m: m(torch.arange(3, 19)[None], torch.arange(21, 37), mask=wide_tree,
                    position_ids=depths),  # a 16-node tree
        lambda m: m.early_exit(torch.tensor([[8]]), 2, 24),  # layer range
    ]
    for ref, got in run_both(model, steps):
        torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=0)


def test_fused_path_is_taken_and_leaves_input_alone() -> None:
    model = Transformer(ARGS).init_random(1, std=0.1).eval()
    model.setup_cache(16)
    h = torch.randn(1, 1, ARGS.dim, generator=gen(6))
    before = h.clone()
    pos = torch.tensor([0])
    cos, sin = model.rope_cos[pos], model.rope_sin_signed[pos]
    out = native.decode_layers(model, 0, ARGS.n_layers, h, cos=cos, sin=sin, pos=pos, mask=None, kv_len=1)
    assert out is not None and out.shape == h.shape
    assert torch.equal(h, before)
    # a registered replacement op must run: the fused default steps aside
    kernels.register("rms_norm", kernels.reference.rms_norm)
    try:
        assert kernels.decode_layers is kernels.reference.decode_layers
    finally:
        kernels.reset()
    assert kernels.decode_layers is native.decode_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_layer_runs_split_into_calls_give_the_same_bits(dtype: torch.dtype, t: int) -> None:
    # a pipeline's stages run layers [0, 1), [1, 2), [2, 3) in calls of their own: the result
    # must be the single call's, bit for bit, or a decentralized run parts from `ar` at a near-tie
    model = Transformer(ARGS, dtype=dtype).init_random(2, std=0.1).eval()
    model.setup_cache(32)
    h = torch.randn(1, t, ARGS.dim, generator=gen(9)).to(dtype)
    pos = torch.arange(4, 4 + t)
    cos, sin = model.rope_cos[pos], model.rope_sin_signed[pos]
    mask = torch.arange(4 + t)[None, :] <= pos[:, None]
    with torch.inference_mode():
        whole = native.decode_layers(model, 0, ARGS.n_layers, h, cos=cos, sin=sin, pos=pos, mask=mask, kv_len=4 + t)
        parts = h
        for lo in range(ARGS.n_layers):
            parts = native.decode_layers(model, lo, lo + 1, parts, cos=cos, sin=sin, pos=pos, mask=mask, kv_len=4 + t)
    assert whole is not None and parts is not None
    assert torch.equal(whole, parts)


def test_scratch_buffers_reused_across_models_and_token_counts() -> None:
    # the layer kernels keep their (cache-line aligned) scratch buffers across calls: a call
    # after one with more tokens, or with a model of other sizes, must read none of the leftovers
    small = Transformer(ARGS).init_random(2, std=0.1).eval()
    wide = Transformer(ModelArgs(dim=96, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=160,
                                 vocab_size=97, max_seq_len=64)).init_random(3, std=0.1).eval()
    steps = {n: [lambda m, n=n: m(torch.arange(1, n + 1)[None], 0)] for n in (1, 3, 5, 8, 16)}
    for model, n in [(wide, 8), (small, 3), (wide, 16), (small, 16), (wide, 5), (small, 8), (small, 1), (wide, 3)]:
        for ref, got in run_both(model, steps[n]):
            torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_odd_model_sizes(dtype: torch.dtype, tol: float) -> None:
    # widths that are not multiples of any vector (dim 56, head_dim 14, FFN 90, vocab 101)
    odd = ModelArgs(dim=56, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90, vocab_size=101, max_seq_len=64)
    model = Transformer(odd, dtype=dtype).init_random(4, std=0.1).eval()
    steps = [lambda m: m(torch.arange(1, 11)[None], 0), lambda m: m(torch.tensor([[5]])),
             lambda m: m(torch.arange(20, 35)[None], 11)]
    for ref, got in run_both(model, steps):
        torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=0)


def test_fused_layers_follow_in_place_weight_updates() -> None:
    model = Transformer(ARGS).init_random(5, std=0.1).eval()
    step = [lambda m: m(torch.arange(1, 5)[None], 0)]
    before = run_both(model, step)[0][1]
    with torch.no_grad():
        model.layers[1].feed_forward.w2.mul_(3.0)
    ref, got = run_both(model, step)[0]
    assert not torch.allclose(got, before, atol=1e-3)  # the change reached the fused kernel
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(dtype: torch.dtype) -> None:
    # A token's logits must not depend on the other tokens of its forward: a k-token verification
    # (k = 2..16), a tree whose masked siblings sit between a node and its parent, and the decode
    # of the same token give bit-identical rows. Greedy bf16 reproduces ar only this way.
    model = Transformer(ARGS, dtype=dtype).init_random(7, std=0.1).eval()
    model.setup_cache(48)
    prompt = torch.randint(0, ARGS.vocab_size, (1, 9), generator=gen(11))
    seq = torch.randint(0, ARGS.vocab_size, (1, 16), generator=gen(12))
    with torch.inference_mode():
        model(prompt, 0)
        decoded = []
        for j in range(16):  # one token at a time: slots 9..24
            decoded.append(model(seq[:, j:j + 1], 9 + j)[0, 0])
        for k in (2, 3, 5, 8, 13, 16):
            model.truncate(9)
            window = model(seq[:, :k], 9)[0]
            for j in range(k):
                assert torch.equal(window[j], decoded[j]), f"{k}-token forward, row {j}"
        # a tree: seq[0] with two children (a sibling first), the second child has one child
        model.truncate(9)
        tokens = torch.stack([seq[0, 0], seq[0, 5], seq[0, 1], seq[0, 2]])[None]
        mask = torch.zeros(4, 13, dtype=torch.bool)
        mask[:, :9] = True
        for node, path in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
            mask[node, [9 + p for p in path]] = True
        tree = model(tokens, torch.arange(9, 13), mask=mask, position_ids=torch.tensor([9, 10, 10, 11]))[0]
        assert torch.equal(tree[0], decoded[0]) and torch.equal(tree[2], decoded[1])
        assert torch.equal(tree[3], decoded[2])


def test_threads_packing_at_once_get_disjoint_panels(monkeypatch) -> None:
    # a target and a draft thread pack their weights at the same time (the threaded schedule
    # runs): no two panels may share bytes of an arena
    import sys
    import threading

    monkeypatch.setattr(native, "HUGE_PAGES", True)
    monkeypatch.setattr(native, "ARENA_BYTES", 64 << 20)
    monkeypatch.setattr(native, "_arena", [])
    spans: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def carve() -> None:
        start.wait()
        for _ in range(300):
            p = native._panel_arena(1000, torch.float32)
            spans.append((p.data_ptr(), p.data_ptr() + 4000))

    threads = [threading.Thread(target=carve) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    spans.sort()
    assert len(spans) == 1200
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
