"""KV cache, tree masks, layer ranges and early exit of real.model.decoder.Transformer.

Each property runs on a tiny random model (fast) and on the bundled SmolLM2 (marked `model`).
The reference is always a plain full-sequence forward from slot 0.
"""

from __future__ import annotations

import pytest
import torch

from real.model.decoder import Transformer
from tests.helpers.real_models import bundled, tiny

# logits agree up to the summation order of GEMMs with different numbers of rows
ATOL = {"tiny": 1e-5, "bundled": 5e-4}

MODELS = ["tiny", pytest.param("bundled", marks=pytest.mark.model)]


def get_model(name: str) -> Transformer:
    return tiny() if name == "tiny" else bundled()[0]


def tokens(model: Transformer, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.args.vocab_size, (1, n), generator=gen)


@torch.inference_mode()
def full(model: Transformer, seq: torch.Tensor) -> torch.Tensor:
    """Reference: the whole sequence in one forward from slot 0 (default causal mask)."""
    return model(seq, 0)


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_incremental_decode_equals_full_forward(name: str) -> None:
    model = get_model(name)
    seq = tokens(model, 12, seed=1)
    ref = full(model, seq)
    # prefill 5, then chunks of 1, 3, 1, 2 tokens continuing at kv_len
    model.truncate(0)
    parts = [model(seq[:, :5])]
    for a, b in [(5, 6), (6, 9), (9, 10), (10, 12)]:
        assert model.kv_len == a
        parts.append(model(seq[:, a:b]))
    got = torch.cat(parts, dim=1)
    assert got.shape == (1, 12, model.args.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=ATOL[name], rtol=0)


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_rollback_overwrites_rejected_slots(name: str) -> None:
    model = get_model(name)
    seq = tokens(model, 10, seed=2)
    ref = full(model, seq)
    model(seq[:, :6], 0)
    model(tokens(model, 4, seed=3), 6)  # "rejected draft" written at slots 6..9
    model.truncate(6)
    got = model(seq[:, 6:])  # continues at slot 6, overwriting the rejected K/V
    torch.testing.assert_close(got, ref[:, 6:], atol=ATOL[name], rtol=0)


# A token tree after a prefix of P tokens: node -> parent (-1 = the last prefix token).
#        prefix ─ 0 ─ 1 ─ 4
#               │   └ 2
#               └ 3
PARENTS = [-1, 0, 0, -1, 1]


def tree_mask(parents: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(mask [T, prefix+T], depths [T], root-to-node paths) for nodes in slots prefix..prefix+T-1."""
    t = len(parents)
    mask = torch.zeros(t, prefix + t, dtype=torch.bool)
    mask[:, :prefix] = True
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
        mask[i, [prefix + j for j in paths[i]]] = True
    depths = torch.tensor([len(path) - 1 for path in paths])
    return mask, depths, paths


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_tree_mask_matches_each_path_as_a_sequence(name: str) -> None:
    model = get_model(name)
    prefix = tokens(model, 7, seed=4)
    nodes = tokens(model, len(PARENTS), seed=5)
    mask, depths, paths = tree_mask(PARENTS, prefix.shape[1])
    p = prefix.shape[1]
    model(prefix, 0)
    got = model(nodes, p + torch.arange(len(PARENTS)), mask=mask, position_ids=p + depths)
    for i, path in enumerate(paths):
        seq = torch.cat([prefix, nodes[:, path]], dim=1)
        torch.testing.assert_close(got[0, i], full(model, seq)[0, -1], atol=ATOL[name], rtol=0)


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_move_kv_compacts_an_accepted_tree_path(name: str) -> None:
    model = get_model(name)
    prefix = tokens(model, 6, seed=6)
    nodes = tokens(model, len(PARENTS), seed=7)
    nxt = tokens(model, 1, seed=8)
    mask, depths, paths = tree_mask(PARENTS, prefix.shape[1])
    p = prefix.shape[1]
    model(prefix, 0)
    model(nodes, p + torch.arange(len(PARENTS)), mask=mask, position_ids=p + depths)
    accepted = paths[4]  # nodes 0, 1, 4
    model.move_kv(p + torch.tensor(accepted), p + torch.arange(len(accepted)))
    model.truncate(p + len(accepted))
    got = model(nxt)[0, -1]
    seq = torch.cat([prefix, nodes[:, accepted], nxt], dim=1)
    torch.testing.assert_close(got, full(model, seq)[0, -1], atol=ATOL[name], rtol=0)


@pytest.mark.parametrize("name", MODELS)
@torch.inference_mode()
def test_layer_ranges_compose_to_the_full_forward(name: str) -> None:
    model = get_model(name)
    seq = tokens(model, 9, seed=9)
    ref = full(model, seq)
    n = model.args.n_layers
    cuts = [0, 1, n // 2, n]
    h = seq
    for lo, hi in zip(cuts, cuts[1:]):  # three pipeline stages
        h = model(h, 0, layers=(lo, hi))
        assert h.shape[-1] == (model.args.dim if hi < n else model.args.vocab_size)
    torch.testing.assert_close(h, ref, atol=ATOL[name], rtol=0)


@torch.inference_mode()
def test_early_exit_equals_a_model_truncated_to_its_first_layers() -> None:
    model = tiny()
    k = 2
    short_args = type(model.args)(**{**vars(model.args), "n_layers": k})
    short = Transformer(short_args)
    short.load_state_dict({key: v for key, v in model.state_dict().items()
                           if not key.startswith("layers.") or int(key.split(".")[1]) < k})
    short.setup_cache()
    seq = tokens(model, 8, seed=10)
    got = model.early_exit(seq, k, 0)
    torch.testing.assert_close(got, short(seq, 0), atol=1e-6, rtol=0)
    assert not torch.allclose(got, model(seq, 0), atol=1e-3)  # really fewer layers


@torch.inference_mode()
def test_stage_cache_only_for_its_layers_and_bounds_are_checked() -> None:
    model = tiny()
    model.setup_cache(max_seq=16, layers=(2, 4))
    assert [layer.attention.kv_cache is not None for layer in model.layers] == [False, False, True, True]
    h = torch.randn(1, 3, model.args.dim)
    assert model(h, 0, layers=(2, 4)).shape == (1, 3, model.args.vocab_size)
    with pytest.raises(RuntimeError, match="setup_cache"):
        model(tokens(model, 3, seed=0), 0)  # layer 0 has no cache on this stage
    with pytest.raises(ValueError, match="beyond the KV cache"):
        model(h, 15, layers=(2, 4))
    with pytest.raises(ValueError, match="mask covers"):
        model(h, 0, mask=torch.ones(3, 2, dtype=torch.bool), layers=(2, 4))


def test_greedy_generate_stops_at_eos_and_checks_the_cache_size() -> None:
    from real.model.generate import greedy_generate

    model = tiny()
    prompt = tokens(model, 5, seed=11)[0].tolist()
    out = greedy_generate(model, prompt, 6)
    assert len(out) == 6
    with torch.inference_mode():  # the loop's tokens are the argmax of a full forward
        ref = full(model, torch.tensor([prompt + out[:-1]]))[0, len(prompt) - 1:].argmax(-1)
    assert out == ref.tolist()
    assert greedy_generate(model, prompt, 6, eos_token_ids=[out[1]]) == out[:2]
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        greedy_generate(model, prompt, model.max_seq)
