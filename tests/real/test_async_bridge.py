"""The async bridge's messages (issue 15, message cost): the subtree's size as the real draft
encodes it, the bridge measured as async uses it, and the simulator charging both."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from real.schedules.async_tree import pack_batch
from sim.runtime.engine import run
from testbed.config import real_dtype
from testbed.links import TREE_NODE_BYTES, TREE_TIMES_BYTES, subtree_message_bytes
from testbed.placement import link_name
from testbed.spec.tree import DraftTree
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.sim.test_cost_profile_tp import profile_with_tp

VOCAB = 50


def _batch(mode: str, budget: int = 6):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    tree = DraftTree(root_token=1, prefix_len=4, mode=mode)  # type: ignore[arg-type]
    leaves = [0]
    for _ in range(3):
        new = tree.expand(leaves, torch.softmax(torch.randn(len(leaves), VOCAB, generator=gen), -1),
                          num_children=2, generator=gen)
        leaves = new[:2]
    return tree.select_subtree(budget)


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_the_subtree_message_size_is_the_real_drafts_payload(mode: str) -> None:
    batch = _batch(mode)
    payload = sum(t.numel() * t.element_size() for t in pack_batch(batch, 0.1, 0.2))
    assert subtree_message_bytes(batch, vocab=VOCAB, sampled=mode == "sample") == payload
    inner = sum(1 for kids in batch.children if kids)
    rows = len(batch.tokens) * TREE_NODE_BYTES + TREE_TIMES_BYTES
    assert payload == rows + (inner * VOCAB * 4 if mode == "sample" else 0) and inner >= 1


def _bridge_run(tmp_path: Path, bridge: dict | None, temperature: float):  # type: ignore[no-untyped-def]
    prof = profile_with_tp()
    if bridge is not None:
        prof.setdefault("links", {})["bridge"] = bridge
    path = tmp_path / f"prof{bridge is not None}{temperature}.json"
    path.write_text(json.dumps(prof))
    res = run(compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "sim.cost_model=profile",
                          f"sim.profile_path={path}", "schedule=async", "schedule.tree_budget=8",
                          "schedule.tree_width=4", "workload.num_prompts=1", "workload.max_new_tokens=24",
                          f"sampling.temperature={temperature}"))
    spans = res.recorder.frames()[2]
    link = spans[spans["resource"] == link_name("draft", "target")]
    return res, (link["end_s"] - link["start_s"]).to_numpy()


def test_simulated_async_sends_its_subtrees_over_the_measured_bridge(tmp_path: Path) -> None:
    """With the profile's bridge table (α 2 ms, 10 ns per byte) a subtree of 8 nodes takes
    α + its bytes × β: at T = 0 its rows only, at T = 1 also the q rows (≥ 1 of the vocabulary);
    without the table the hardware's link (20 µs, 5 GB/s) carries it."""
    bridge = {"alpha_s": 0.002, "beta_s_per_byte": 1e-8, "bytes": [64], "seconds": [0.002]}
    _, greedy = _bridge_run(tmp_path, bridge, 0.0)
    assert len(greedy) > 3
    assert greedy == pytest.approx([0.002 + (8 * TREE_NODE_BYTES + TREE_TIMES_BYTES) * 1e-8] * len(greedy))
    _, sampled = _bridge_run(tmp_path, bridge, 1.0)
    vocab = compose_exp("pair=smollm2_135m+smollm2_draft").pair.target.vocab
    assert vocab > 1000 and min(sampled) >= 0.002 + vocab * 4 * 1e-8
    _, plain = _bridge_run(tmp_path, None, 1.0)
    assert max(plain) < 0.002


def test_a_two_core_profile_without_the_bridge_table_is_measured_again(tmp_path: Path) -> None:
    from real.calibrate.ensure_profile import profile_is_current
    from real.calibrate.profile import SCHEMA

    exp = compose_exp("pair=smollm2_135m+smollm2_draft", "hardware=local", "backend=real")
    prof = profile_with_tp()
    prof.update(schema=SCHEMA, dtype=real_dtype(exp), probe={
        "gbps": 10.0, "forward_s": {name: 0.01 for name in prof["models"]}})
    prof["models"]["smollm2_135m"]["contended"] = {"smollm2_draft": {"k": [8], "factor": [1.0]}}
    prof.setdefault("links", {}).pop("bridge", None)
    path = tmp_path / "local.json"
    path.write_text(json.dumps(prof))
    current, why = profile_is_current(path, exp)
    assert not current and "bridge" in why
    prof["links"]["bridge"] = {"alpha_s": 0.001, "beta_s_per_byte": 1e-9}
    path.write_text(json.dumps(prof))
    assert profile_is_current(path, exp) == (True, "current")


@pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2, reason="needs two cores (one worker per core)")
def test_the_bridge_is_measured_between_the_two_pinned_groups_of_an_async_run() -> None:
    from real.calibrate.bridge import BridgeGrid, measure_bridge

    grid = BridgeGrid(bytes=[64, 300_000], repeats=2, busy_s=0.005)
    lines: list[str] = []
    table = measure_bridge(compose_exp("backend=real", "hardware=local"), grid, log=lines.append)
    assert table["bytes"] == [64, 300_000] and len(table["seconds"]) == 2
    assert all(0 < s < 1.0 for s in table["seconds"]) and table["alpha_s"] >= 0 and table["busy_s"] == 0.005
    assert len(lines) == 1 and lines[0].startswith("bridge: 64B=")
    assert live_workers() == []
