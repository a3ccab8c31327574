"""Tensor parallelism (real/model/tp.py, specbed_kernels/allreduce.py): TP=2 in two spawned processes gives the
logits of TP=1, for every all-reduce backend and through both the op-by-op and the fused native
paths; the uneven head split; shared-memory all-reduce timeouts name the missing peer."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specbed_kernels as kernels
from real.model.decoder import ModelArgs, Transformer
from real.model.tp import even_split, plan_shards
from specbed_kernels import native

# 9 query heads / 3 KV heads: at TP=2 rank 0 holds 2 KV groups, rank 1 one; FFN 100 -> 50 + 50
TINY_TP = ModelArgs(dim=72, n_layers=3, n_heads=9, n_kv_heads=3, ffn_dim=100, vocab_size=97,
                    max_seq_len=64)
TOL = 1e-4
SPAWN_TIMEOUT_S = 120


# ------------------------------------------------------------------------- a minimal spawner
def _entry(rank: int, fn, world: int, store_path: str, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        fn(rank, world, Path(out_dir), *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, tmp_path: Path, *args, world: int = 2) -> None:
    """Run ``fn(rank, world, out_dir, *args)`` in ``world`` processes joined by gloo (FileStore in
    ``tmp_path``); fail if any raises or they outlive SPAWN_TIMEOUT_S; assert none is left."""
    ctx = mp.spawn(_entry, args=(fn, world, str(tmp_path / "store"), str(tmp_path), args),
                   nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"TP workers still running after {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    pids = [p.pid for p in ctx.processes]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "a worker process was left"


# ------------------------------------------------------------------------- the scenarios
def _tiny() -> Transformer:
    model = Transformer(TINY_TP).init_random(seed=3, std=0.1)
    model.setup_cache(48)
    return model.eval()


def _tree_mask(prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    # 6 nodes: root(0) -> 1, 2; 1 -> 3, 4; 2 -> 5 (slots prefix.., RoPE at prefix + depth)
    parent = [-1, 0, 0, 1, 1, 2]
    n = len(parent)
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    depth = []
    for i, p in enumerate(parent):
        mask[i, prefix + i] = True
        if p >= 0:
            mask[i, prefix:prefix + n] |= mask[p, prefix:prefix + n]
        depth.append(0 if p < 0 else depth[p] + 1)
    return mask, prefix + torch.tensor(depth)


def _scenarios(model: Transformer) -> dict[str, torch.Tensor]:
    """Prefill (12 tokens), a 1-token decode, a 6-node tree (non-square mask), a 16-token
    verification window: their logits."""
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, TINY_TP.vocab_size, (1, 12), generator=gen)
    tree = torch.randint(0, TINY_TP.vocab_size, (1, 6), generator=gen)
    mask, rope = _tree_mask(13)
    out = {}
    with torch.inference_mode():
        model.truncate(0)
        out["prefill"] = model(prompt, 0)
        out["decode"] = model(prompt[:, -1:], 12)
        out["tree"] = model(tree, torch.arange(13, 19), mask=mask, position_ids=rope)
        model.truncate(13)
        window = torch.randint(0, TINY_TP.vocab_size, (1, 16), generator=gen)
        out["window16"] = model(window, 13)
    return out


def _reference_and_sharded(rank: int, world: int, out: Path, backend: str) -> None:
    from real.model.tp import apply_tp

    fused = []  # decode_layers calls that ran the native kernel (did not step aside)
    default_fused = kernels.get("decode_layers")

    def counting(*a, **kw):
        h = default_fused(*a, **kw)
        fused.append(h is not None)
        return h

    model = apply_tp(_tiny(), rank=rank, world=world, allreduce=backend)
    results = {}
    for kind in ("default", "reference"):
        if kind == "reference":
            kernels.use_reference()
        else:
            kernels.register("decode_layers", counting)
        results[kind] = _scenarios(model)
        kernels.reset()
    results["fused_calls"] = sum(fused)
    torch.save(results, out / f"rank{rank}.pt")


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_tp2_equals_tp1(tmp_path: Path, backend: str) -> None:
    expect = _scenarios(_tiny())
    spawn(_reference_and_sharded, tmp_path, backend)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for kind in ("default", "reference"):
            for name, logits in expect.items():
                diff = (got[kind][name] - logits).abs().max().item()
                assert diff < TOL, f"rank {rank}, {kind} kernels, {name}: max |diff| {diff:.2e}"
        if native.AVAILABLE:
            # the decode and the tree went through the fused kernel, which therefore all-reduced
            assert got["fused_calls"] >= 2


def test_fused_path_steps_aside_without_allreduce() -> None:
    # a sharded model whose all-reduce the kernel cannot call: the op-by-op path must take over
    from real.model.tp import _shard_attention, _shard_ffn

    model = _tiny()
    shard = plan_shards(model.args, 2)[1]
    for layer in model.layers:
        _shard_attention(layer.attention, model.args, shard)
        _shard_ffn(layer.feed_forward, model.args, shard)
    model.setup_cache(48)
    h = torch.randn(1, 1, TINY_TP.dim)
    pos = torch.tensor([0])
    cos, sin = model.rope_cos[pos], model.rope_sin_signed[pos]
    with torch.inference_mode():
        assert native.decode_layers(model, 0, 3, h, cos=cos, sin=sin, pos=pos, mask=None, kv_len=1) is None

        class NoNative:
            rank, world = 1, 2

            def native(self):
                return None

        model.tp_allreduce = NoNative()
        assert native.decode_layers(model, 0, 3, h, cos=cos, sin=sin, pos=pos, mask=None, kv_len=1) is None


def test_uneven_head_split() -> None:
    assert even_split(7, 3) == [3, 2, 2]
    assert even_split(1536, 2) == [768, 768]
    smollm = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152)
    s0, s1 = plan_shards(smollm, 2)
    assert (s0.kv_heads, s0.q_heads, s0.ffn) == ((0, 2), (0, 6), (0, 768))
    assert (s1.kv_heads, s1.q_heads, s1.ffn) == ((2, 3), (6, 9), (768, 1536))
    draft = ModelArgs(dim=192, n_layers=4, n_heads=3, n_kv_heads=3, ffn_dim=1025, vocab_size=49152)
    shards = plan_shards(draft, 2)
    assert [(s.n_heads, s.n_kv_heads, s.ffn_dim) for s in shards] == [(2, 2, 513), (1, 1, 512)]
    assert [s.n_heads for s in plan_shards(smollm, 3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="at least 4 KV heads"):
        plan_shards(smollm, 4)


def _shm_peer_missing(rank: int, world: int, out: Path) -> None:
    from specbed_kernels.allreduce import ShmAllReduce

    ar = ShmAllReduce(timeout_s=1.0)
    if rank == 0:  # rank 0 removes the file once all have mapped it: nothing left even on a crash
        assert not Path(ar.path).exists()
    x = torch.full((10,), float(rank + 1))
    ar(x)  # both ranks: 1 + 2
    assert torch.equal(x, torch.full((10,), 3.0))
    big = torch.arange(300_000, dtype=torch.float32)  # > capacity: goes in chunks
    ar(big)
    assert torch.equal(big, 2 * torch.arange(300_000, dtype=torch.float32))
    if rank == 0:
        start = time.monotonic()
        try:
            ar(x)  # rank 1 never comes
        except TimeoutError as exc:
            (out / "error.txt").write_text(f"{exc}\n{time.monotonic() - start}")


def test_shm_allreduce_times_out_naming_the_peer(tmp_path: Path) -> None:
    spawn(_shm_peer_missing, tmp_path)
    message, waited = (tmp_path / "error.txt").read_text().splitlines()
    assert "rank 0 waited 1 s for rank 1" in message
    assert 1.0 <= float(waited) < 10


# ------------------------------------------------------------------------- the bundled model
def _bundled_sharded(rank: int, world: int, out: Path) -> None:
    from real.model.tp import apply_tp
    from tests.helpers.real_models import bundled

    model, tok = bundled()
    apply_tp(model, rank=rank, world=world, allreduce="shm")
    torch.save(_bundled_run(model, tok), out / f"rank{rank}.pt")


def _bundled_run(model: Transformer, tok) -> dict[str, torch.Tensor]:
    ids = torch.tensor([tok.encode("def fibonacci(n):")])
    with torch.inference_mode():
        model.truncate(0)
        logits = model(ids, 0)
        tokens = [int(logits[0, -1].argmax())]
        for i in range(15):
            tokens.append(int(model(torch.tensor([[tokens[-1]]]), ids.shape[1] + i)[0, -1].argmax()))
    return {"logits": logits, "tokens": torch.tensor(tokens)}


@pytest.mark.model
@pytest.mark.slow  # ~40 s quiet; the tiny-model TP tests above run by default
def test_bundled_tp2_equals_tp1(tmp_path: Path) -> None:
    from tests.helpers.real_models import bundled

    expect = _bundled_run(*bundled())
    spawn(_bundled_sharded, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        diff = (got["logits"] - expect["logits"]).abs().max().item()
        assert diff < TOL, f"rank {rank}: max |diff| {diff:.2e}"
        assert got["tokens"].tolist() == expect["tokens"].tolist()
