"""testbed.placement: groups, ranks, channels and links from the experiment config."""

from __future__ import annotations

import pytest

from testbed.config import ConfigError, ExperimentConfig
from testbed.placement import make_placement
from tests.conftest import compose_exp

REAL = ("backend=real",)


def test_single_layout_runs_both_models_on_the_target_group() -> None:
    pl = make_placement(compose_exp(*REAL, "placement.target_gpus=2", "placement.draft_gpus=2"),
                        devices=2)
    assert pl.layout == "single" and pl.world_size == 2
    (g,) = pl.groups
    assert g.name == "target" and g.ranks == (0, 1) and g.models == ("target", "draft")
    assert [c.name for c in pl.channels] == ["tp:target"] and not pl.links
    assert pl.draft_group == "target" and pl.rank(1).index == 1 and pl.rank(1).describe() == "rank 1 (target)"
    ar = make_placement(compose_exp(*REAL, "schedule=ar", "placement.target_gpus=1"), devices=2)
    assert ar.world_size == 1 and ar.groups[0].models == ("target",) and ar.draft_group is None


def test_tree_layout_uses_every_device_of_the_placement() -> None:
    pl = make_placement(compose_exp("schedule=sync", "schedule.tree=true", "placement.target_gpus=4",
                                    "placement.draft_gpus=8"))
    assert pl.layout == "tree" and pl.world_size == 8 and pl.groups[0].tp == 8


def test_async_layout_has_disjoint_groups_and_a_bridge_between_leaders() -> None:
    pl = make_placement(compose_exp("schedule=async", "placement.target_gpus=5", "placement.draft_gpus=3"))
    t, d = pl.group("target"), pl.group("draft")
    assert pl.layout == "two_groups"  # as async declares it (testbed.schedules)
    assert t.ranks == (0, 1, 2, 3, 4) and d.ranks == (5, 6, 7) and pl.world_size == 8
    bridge = pl.channel("bridge:draft<->target")
    assert bridge.ranks == (t.leader, d.leader) == (0, 5)
    assert bridge.links == ("link draft->target", "link target->draft")
    assert {c.name for c in pl.channels} == {"tp:target", "tp:draft", "bridge:draft<->target"}
    assert not pl.link("draft", "target").emulated  # one machine: NVLink, modelled by the sim only
    assert [r.role for r in pl.ranks] == ["target"] * 5 + ["draft"] * 3


def test_pipeline_layout_is_one_stage_per_node_with_contiguous_layers() -> None:
    exp = compose_exp("schedule=decentralized", "hardware=h100x8", "network=wan",
                      "placement.nodes=3", "placement.target_gpus=2", "pair=llama3_8b+llama3_2_1b")
    pl = make_placement(exp)
    assert [g.layers for g in pl.stages()] == [(0, 11), (11, 22), (22, 32)]
    assert [g.ranks for g in pl.groups] == [(0, 1), (2, 3), (4, 5)]
    assert [g.machine for g in pl.groups] == [0, 1, 2] and pl.draft_group == "stage0"
    assert pl.groups[0].models == ("target", "draft") and pl.groups[1].models == ("target",)
    stage = [c for c in pl.channels if c.kind == "stage"]
    assert [(c.name, c.ranks) for c in stage] == [("stage:stage0->stage1", (0, 2)),
                                                 ("stage:stage1->stage2", (2, 4)),
                                                 ("stage:stage2->stage0", (4, 0))]
    lk = pl.link("stage2", "stage0")
    assert lk.emulated and lk.model.latency_s == pytest.approx(0.020)
    assert lk.model.bandwidth_Bps == pytest.approx(0.125e9) and lk.model.jitter_s == pytest.approx(0.002)
    assert pl.rank(3).describe() == "rank 3 (target, group stage1, layers 11-22)"


def _real(*overrides: str) -> ExperimentConfig:
    """An experiment checked as backend=real would be (composed on sim: the real schedule list
    is not this module's business)."""
    exp = compose_exp("hardware=h100x8", *overrides)
    exp.backend = "real"
    return exp


def test_impossible_real_placements_name_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"placement.target_gpus=2 \+ placement.draft_gpus=1 needs 3 "
                                          r"devices but this machine has 2 cores"):
        make_placement(_real("schedule=async", "placement.target_gpus=2", "placement.draft_gpus=1"),
                       devices=2)
    with pytest.raises(ConfigError, match="placement.nodes=2 x placement.target_gpus=2 needs 4"):
        make_placement(_real("schedule=decentralized", "placement.nodes=2", "placement.target_gpus=2"),
                       devices=2)
    with pytest.raises(ConfigError, match="placement.draft_gpus=2 must equal placement.target_gpus=1"):
        make_placement(_real("placement.target_gpus=1", "placement.draft_gpus=2"), devices=2)
    with pytest.raises(ConfigError, match="2 machines have 2 each"):
        make_placement(_real("placement.target_gpus=8", "placement.draft_gpus=8"), devices=2, hosts=2)
    ok = make_placement(_real("schedule=decentralized", "placement.nodes=2",
                              "placement.target_gpus=1", "placement.draft_gpus=1"), devices=2)
    assert ok.world_size == 2 and len(ok.links) == 2
    sim = make_placement(compose_exp("hardware=h100x8", "placement.target_gpus=8"), devices=2)
    assert sim.world_size == 8  # the simulator models the hardware's GPUs, not this machine



def test_receive_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="real.recv_timeout_s"):
        compose_exp("real.recv_timeout_s=0")
    assert compose_exp("real.recv_timeout_s=2.5").real.recv_timeout_s == 2.5


def test_cuda_without_cuda_says_so_and_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"^real.device=cuda: CUDA is not available on this machine .*"
                                          r"real.device=cpu$") as e:
        make_placement(_real("placement.target_gpus=1", "placement.draft_gpus=1", "real.device=cuda"),
                       devices=0)
    assert e.value.key == "real.device" and "lower it" not in str(e.value)
