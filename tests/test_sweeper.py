"""hydra_plugins.specbed_sweeper.GridsSweeper: several Cartesian grids in one sweep (`+sweep=validate`)."""

from __future__ import annotations

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from hydra_plugins.specbed_sweeper.grids_sweeper import GridsSweeper
from tests.conftest import CONF


def jobs(sweeper: GridsSweeper, *cli: str) -> list[list[str]]:
    parsed = OverridesParser.create().parse_overrides(
        [f"{k}={v}" for k, v in sweeper.params.items()] + list(cli))
    return [job for batch in sweeper.split_arguments(parsed, None) for job in batch]


def test_every_grid_runs_its_product_with_the_last_axis_last() -> None:
    s = GridsSweeper(params={"a": "1,2", "role": "x,y"}, grids={"wide": {"a": "7", "b": "3,4"}})
    got = jobs(s)
    assert got[:4] == [["a=1", "role=x"], ["a=1", "role=y"], ["a=2", "role=x"], ["a=2", "role=y"]]
    assert got[4:] == [["a=7", "b=3", "role=x"], ["a=7", "b=3", "role=y"],
                       ["a=7", "b=4", "role=x"], ["a=7", "b=4", "role=y"]]


def test_command_line_applies_to_every_grid_and_only_selects() -> None:
    s = GridsSweeper(params={"a": "1,2", "role": "x"}, grids={"wide": {"a": "7", "b": "3"}}, only=["wide"])
    assert jobs(s, "c=5") == [["a=7", "b=3", "role=x", "c=5"]]
    assert jobs(s, "a=9") == [["a=9", "b=3", "role=x"]]  # the command line wins, as over params
    with pytest.raises(ValueError, match="no grid named nope"):
        GridsSweeper(params={"a": "1"}, grids={"wide": {"a": "2"}}, only=["nope"])


def test_validate_sweep_has_the_serial_tree_grid_at_tp_1_and_2() -> None:
    sw = OmegaConf.load(CONF / "sweep" / "validate.yaml").hydra.sweeper
    s = GridsSweeper(params=dict(sw.params), grids=OmegaConf.to_container(sw.grids), only=["tree"])
    got = jobs(s)
    assert len(got) == 2 * 2 * 3  # depths x TP x roles
    assert {j[-1] for j in got[:3]} == {"+validate=calibrate", "+validate=measure", "+validate=predict"}
    assert all("schedule.tree=True" in j and "pair=smollm2_135m+smollm2_draft" in j for j in got)
    assert {next(o for o in j if o.startswith("+tp=")) for j in got} == {"+tp=tp1", "+tp=tp2"}


def test_validate_sweep_has_the_async_grid() -> None:
    from tests.conftest import compose_exp

    sw = OmegaConf.load(CONF / "sweep" / "validate.yaml").hydra.sweeper
    s = GridsSweeper(params=dict(sw.params), grids=OmegaConf.to_container(sw.grids), only=["async"])
    got = jobs(s)
    assert len(got) == 2 * 2 * 2 * 2 * 3  # pairs x workloads x temperatures x budgets x roles
    seen = set()
    for job in got[::3]:
        exp = compose_exp("+sweep=validate", *[o for o in job if not o.startswith("+validate")])
        seen.add((exp.pair.name, exp.workload.name, exp.sampling.temperature, exp.schedule.tree_budget))
        assert exp.schedule.name == "async" and exp.placement.target_gpus == exp.placement.draft_gpus == 1
    assert len(seen) == 16
    assert {p for p, *_ in seen} == {"smollm2_135m+smollm2_draft", "smollm2_135m+ngram3"}
