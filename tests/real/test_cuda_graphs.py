"""The CUDA-graph forward (real/model/cuda_graphs.py): its captured body is the model's chain forward.

The body runs eagerly on the CPU here and must give the logits and the KV cache of
``Transformer.forward`` at the same slots; where a GPU is present, the replayed graph must too.
"""

from __future__ import annotations

import pytest
import torch

from real.model.batch import CacheRows
from real.model.cuda_graphs import GraphedForwards
from real.model.decoder import Transformer
from real.model.runners import chain_logits
from tests.helpers.real_models import TINY


def _model(device: str = "cpu") -> Transformer:
    model = Transformer(TINY, dtype=torch.float32, device=device).init_random(seed=3)
    model.setup_cache(48)
    return model.eval()


def _caches(model: Transformer) -> list[torch.Tensor]:
    return [c.clone() for layer in model.layers for c in (layer.attention.kv_cache.k_cache,
                                                          layer.attention.kv_cache.v_cache)]


@pytest.mark.parametrize(("start", "k"), [(5, 1), (9, 3), (20, 8), (31, 16)])
@torch.inference_mode()
def test_static_body_equals_the_forward(start: int, k: int) -> None:
    gen = torch.Generator().manual_seed(start)
    prefix = torch.randint(0, TINY.vocab_size, (1, start), generator=gen)
    window = torch.randint(0, TINY.vocab_size, (1, k), generator=gen)
    eager, static = _model(), _model()
    for m in (eager, static):
        m(prefix, input_pos=0)
    want = eager(window, input_pos=start)[0]
    got = GraphedForwards(static).static_logits(window, torch.arange(start, start + k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(_caches(static), _caches(eager)):
        torch.testing.assert_close(a[:, :, : start + k], b[:, :, : start + k], rtol=1e-6, atol=1e-6)


def test_graphs_never_apply_off_cuda() -> None:
    model = _model()
    model.graph_forwards = GraphedForwards(model)
    assert not GraphedForwards.applies(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), input_pos=0)
        got = chain_logits(model, [4, 5], 3)  # falls back to the eager forward
    assert got.shape == (2, TINY.vocab_size) and model.graph_forwards.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_replayed_graph_equals_eager_on_cuda() -> None:
    eager, graphed = _model("cuda"), _model("cuda")
    graphed.graph_forwards = GraphedForwards(graphed)
    ids = list(range(1, 12))
    for m in (eager, graphed):
        m(torch.tensor([ids]), input_pos=0)
    for start, window in ((11, [7]), (12, [3, 4, 5]), (15, [9] * 16), (31, [2])):
        want = eager(torch.tensor([window], device="cuda"), input_pos=start)[0].cpu()
        got = chain_logits(graphed, window, start)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert graphed.kv_len == eager.kv_len == start + len(window)
    assert graphed.graph_forwards.replays == 4


def _tree_inputs(start: int, k: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random tree of k nodes after a prefix of ``start`` slots: each node sees the prefix,
    its ancestors and itself; its RoPE position is the prefix length plus its depth."""
    gen = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) if i else -1 for i in range(1, k)]
    depth = [0] * k
    mask = torch.zeros(k, width, dtype=torch.bool)
    mask[:, :start] = True
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, start + j] = True
            j = parent[j]
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    return torch.arange(start, start + k), mask, torch.tensor([start + d for d in depth])


@pytest.mark.parametrize(("start", "k"), [(6, 4), (20, 16)])
@torch.inference_mode()
def test_static_body_equals_the_tree_masked_forward(start: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    prefix = torch.randint(0, TINY.vocab_size, (1, start), generator=gen)
    nodes = torch.randint(0, TINY.vocab_size, (1, k), generator=gen)
    slots, mask, positions = _tree_inputs(start, k, start + k, seed=start)
    eager, static = _model(), _model()
    for m in (eager, static):
        m(prefix, input_pos=0)
    want = eager(nodes, input_pos=slots, mask=mask, position_ids=positions)[0]
    full = torch.zeros(k, static.max_seq, dtype=torch.bool)
    full[:, : start + k] = mask
    got = GraphedForwards(static).static_logits(nodes, slots, positions, full)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_caches(static), _caches(eager)):
        torch.testing.assert_close(a[:, :, : start + k], b[:, :, : start + k], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_replayed_tree_graph_equals_eager_on_cuda() -> None:
    from real.model.tree_tokens import LocalModel

    eager, graphed = _model("cuda"), _model("cuda")
    graphed.graph_forwards = GraphedForwards(graphed)
    graphed.graph_forwards.prepare(range(1, 17), tree=True)
    captured = graphed.graph_forwards.captures
    assert captured == 32
    ids = list(range(1, 12))
    for m in (eager, graphed):
        m(torch.tensor([ids]), input_pos=0)
    kept = []
    for k, seed in ((3, 1), (8, 2), (16, 3)):
        slots, mask, positions = _tree_inputs(11, k, 11 + k, seed)
        tokens = [(7 * i + seed) % TINY.vocab_size for i in range(k)]
        want = eager(torch.tensor([tokens], device="cuda"), input_pos=slots, mask=mask,
                     position_ids=positions)[0].cpu()
        got = LocalModel(graphed).logits(tokens, input_pos=slots, mask=mask, position_ids=positions)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the serial tree at temperature 0 keeps them on the device: the same logits, its own copy
        on_device = LocalModel(graphed, device_logits=True).logits(tokens, input_pos=slots, mask=mask,
                                                                   position_ids=positions)
        assert on_device.device.type == "cuda"
        kept.append((on_device, want))
    for on_device, want in kept:  # later replays rewrote the graphs' outputs, not these
        torch.testing.assert_close(on_device.cpu(), want, rtol=1e-4, atol=1e-4)
    assert graphed.graph_forwards.replays == 6 and graphed.graph_forwards.captures == captured


# ------------------------------------------------------------- batched forwards (under load)
def _batch_model(device: str = "cpu") -> tuple[Transformer, CacheRows]:


    model = Transformer(TINY, dtype=torch.float32, device=device).init_random(seed=3).eval()
    return model, CacheRows(model, 4, 48)


def _batch_prompts(rows: CacheRows) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (5, 12, 3)]
    for row, p in enumerate(prompts, start=1):
        rows.prefill(row, p)
    return prompts


@torch.inference_mode()
def test_static_batch_body_equals_the_batched_forward() -> None:
    """Three requests, windows of 1, 4 and 2 tokens padded to a batch of 4 x 4 tokens: each
    request's logits and the K/V of its own slots equal forward_batch's (whose rows equal a
    request served alone)."""
    from real.model.batch import Feed, forward_batch
    from real.model.batch_graphs import static_batch_logits

    (eager, eager_rows), (static, static_rows) = _batch_model(), _batch_model()
    prompts = _batch_prompts(eager_rows)
    _batch_prompts(static_rows)
    windows = [[4], [9, 8, 7, 6], [1, 2]]
    feeds = [Feed(row, w, len(p)) for row, (p, w) in enumerate(zip(prompts, windows), start=1)]
    want = forward_batch(eager, feeds)
    tokens = torch.zeros(4, 4, dtype=torch.long)
    slots = torch.arange(4).repeat(4, 1)
    rows = torch.zeros(4, dtype=torch.long)
    for i, f in enumerate(feeds):
        tokens[i, :len(f.tokens)] = torch.tensor(f.tokens)
        slots[i] += f.start
        rows[i] = f.row
    got = static_batch_logits(static, tokens, slots, rows)
    for i, f in enumerate(feeds):
        torch.testing.assert_close(got[i, :len(f.tokens)], want[i], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[i, :len(f.tokens)].argmax(-1), want[i].argmax(-1))
        end = f.start + len(f.tokens)
        for layer_s, layer_e in zip(static.layers, eager.layers):
            for a, b in ((layer_s.attention.kv_cache.k_cache, layer_e.attention.kv_cache.k_cache),
                         (layer_s.attention.kv_cache.v_cache, layer_e.attention.kv_cache.v_cache)):
                torch.testing.assert_close(a[f.row, :, :end], b[f.row, :, :end], rtol=1e-5, atol=1e-5)


def test_batch_graphs_never_apply_off_cuda() -> None:
    from real.model.batch import Feed, forward_batch
    from real.model.batch_graphs import GraphedBatches

    model, rows = _batch_model()
    model.graph_batches = GraphedBatches(model)
    _batch_prompts(rows)
    with torch.inference_mode():
        got = forward_batch(model, [Feed(1, [4], 5), Feed(2, [5, 6], 12)])  # the eager (native) path
    assert [g.shape for g in got] == [(1, TINY.vocab_size), (2, TINY.vocab_size)]
    assert model.graph_batches.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_replayed_batch_graph_equals_eager_on_cuda() -> None:
    from real.model.batch import Feed, forward_batch
    from real.model.batch_graphs import GraphedBatches

    (eager, eager_rows), (graphed, graphed_rows) = _batch_model("cuda"), _batch_model("cuda")
    graphed.graph_batches = GraphedBatches(graphed)
    prompts = _batch_prompts(eager_rows)
    _batch_prompts(graphed_rows)
    lengths = [len(p) for p in prompts]
    for windows in ([[4], [9, 8, 7], [1, 2]], [[3], [5], [6]], [[2, 2], [1], [8]]):
        feeds = [Feed(row, w, lengths[row - 1]) for row, w in enumerate(windows, start=1)]
        want, got = forward_batch(eager, feeds), forward_batch(graphed, feeds)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.cpu(), rtol=1e-4, atol=1e-4)
        lengths = [n + len(w) for n, w in zip(lengths, windows)]
    assert graphed.graph_batches.replays == 3 and graphed.graph_batches.captures == 3
