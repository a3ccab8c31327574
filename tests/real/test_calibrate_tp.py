"""real/calibrate/tp.py on tiny random checkpoints: the TP 1/2 chain and tree tables, the
all-reduce and round-trip tables come back complete and well-formed, and no worker is left
(nothing about the values: timings are never asserted)."""

from __future__ import annotations

import psutil
import pytest
import torch

from real.calibrate.tp import SHAPES, TpGrid, measure_tp, tree_mask
from tests.conftest import compose_exp
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint


def test_tree_mask_sees_context_ancestors_and_itself() -> None:
    mask, depths = tree_mask(5, 3)
    assert mask.shape == (5, 8)
    assert mask[:, :3].all()
    # binary heap: 0 <- 1, 2; 1 <- 3, 4
    assert mask[3, 3:].tolist() == [True, True, False, True, False]
    assert mask[2, 3:].tolist() == [True, False, True, False, False]
    assert depths.tolist() == [0, 1, 1, 2, 2]
    assert torch.equal(mask[0, 3:], torch.tensor([True, False, False, False, False]))


@pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2, reason="needs two cores")
def test_quick_measurement_has_every_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=2)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=2)
    exp = compose_exp("backend=real", "hardware=local")
    grid = TpGrid.quick()
    out = measure_tp(exp, {"t": str(target), "d": str(draft)}, grid, log=lambda _: None)
    for name in ("t", "d"):
        tp = out["models"][name]["tp"]
        assert sorted(tp) == ["1", "2"]
        for degree in tp.values():
            for shape in SHAPES:
                t = degree[shape]
                assert t["k"] == grid.k and t["context"] == grid.context
                assert len(t["seconds"]) == len(grid.context) and all(len(r) == len(grid.k) for r in t["seconds"])
                assert all(v > 0 for r in t["seconds"] for v in r)
                assert all(r == sorted(r) for r in t["seconds"])  # smoothed: non-decreasing in k
    for kind in ("shm", "gloo"):
        assert out["allreduce"][kind]["bytes"] == [4 * n for n in grid.allreduce_floats]
        assert len(out["allreduce"][kind]["seconds"]) == len(grid.allreduce_floats)
    assert out["round_trip"]["gloo_loopback"]["bytes"] == grid.message_bytes
    alive = [p for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())]
    assert not alive


def test_a_gpu_profile_gets_no_cpu_core_tables(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a GPU the two pinned workers would time CPU cores: the profile keeps TP 1 only (and
    says so) instead of CPU tables that would reshape the GPU's forwards."""
    import dataclasses

    import real.calibrate.tp as tp
    from real.calibrate.profile import _measure_tp

    exp = compose_exp("backend=real")
    gpu = dataclasses.replace(exp, real=dataclasses.replace(exp.real, device="cuda"))

    def launched(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the CPU workers were launched")

    monkeypatch.setattr(tp, "measure_tp", launched)
    said: list[str] = []
    assert _measure_tp(gpu, {}, None, said.append) == {}
    assert said and "real.device=cuda" in said[0]
