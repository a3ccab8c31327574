"""hydra_plugins.specbed_sweeper.GridsSweeper: several Cartesian grids in one sweep (`+sweep=validate`)."""

from __future__ import annotations

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
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


def test_a_grid_sets_the_last_axis_with_its_own_values() -> None:
    s = GridsSweeper(params={"a": "1", "rate": "1,2"}, grids={"slow": {"a": "3", "rate": "0.5,0.25"}})
    assert jobs(s)[2:] == [["a=3", "rate=0.5"], ["a=3", "rate=0.25"]]
    assert jobs(s, "rate=9")[-1] == ["a=3", "rate=9"]  # the command line still wins


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


def test_the_sweeper_is_installed_with_the_package(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # every sweep uses it (conf/config.yaml): it must import from any directory, not only the
    # repository root (a namespace package the install has to map)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import hydra_plugins.specbed_sweeper.grids_sweeper as g; "
                          "import hydra_plugins.hydra_joblib_launcher; print(g.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-500:]


def test_up_front_check_composes_once_per_group_choice_and_still_rejects_bad_values(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from testbed.compose import register_configs

    register_configs([])
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["+sweep=wan"], return_hydra_config=True)
        loader = GlobalHydra.instance().config_loader()
    sweeper = GridsSweeper(params={})
    sweeper.config = cfg

    class Ctx:
        config_loader = loader

    sweeper.hydra_context = Ctx()  # type: ignore[assignment]
    calls = []
    real = ConfigLoaderImpl.load_sweep_config  # Hydra's composition, under the sweeper's cache
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config",
                        lambda self, c, o: calls.append(o) or real(self, c, o))
    jobs = [[f"network.latency_ms={lat}", f"+split={s}"] for s in ("t1", "t2") for lat in (0, 5, 20)]
    sweeper.validate_batch_is_legal(jobs)
    assert len(calls) == 2  # one composition per +split choice, not six
    with pytest.raises(Exception, match="latency_ms"):
        sweeper.validate_batch_is_legal([["network.latency_ms=0"], ["network.latency_ms=fast"]])
    with pytest.raises(Exception, match="no_such_key"):
        sweeper.validate_batch_is_legal([["network.latency_ms=0"], ["network.no_such_key=1"]])


def test_validate_sweep_has_the_async_grid() -> None:
    from tests.conftest import compose_exp

    sw = OmegaConf.load(CONF / "sweep" / "validate.yaml").hydra.sweeper
    s = GridsSweeper(params=dict(sw.params), grids=OmegaConf.to_container(sw.grids), only=["async"])
    got = jobs(s)
    assert len(got) == 2 * 2 * 2 * 3  # pairs x workloads x temperatures x roles
    seen = set()
    for job in got[::3]:
        exp = compose_exp("+sweep=validate", *[o for o in job if not o.startswith("+validate")])
        seen.add((exp.pair.name, exp.workload.name, exp.sampling.temperature, exp.schedule.tree_budget))
        assert exp.schedule.name == "async" and exp.placement.target_gpus == exp.placement.draft_gpus == 1
    assert len(seen) == 8
    assert {p for p, *_ in seen} == {"smollm2_135m+smollm2_draft", "smollm2_135m+ngram3"}


def test_validate_covers_every_family_at_a_default_size_that_fits_90_minutes() -> None:
    """Chain, serial tree, DSD, async, the lookahead policies and serving under load in one
    default sweep of 192 jobs (~75 minutes estimated); each dynamic policy's cap is a static γ of the chain grid, whose
    trace its prediction replays (sim/oracle/trace.py prefers static recordings)."""
    from tests.conftest import compose_exp

    sw = OmegaConf.load(CONF / "sweep" / "validate.yaml").hydra.sweeper
    grids = OmegaConf.to_container(sw.grids)
    every = jobs(GridsSweeper(params=dict(sw.params), grids=grids))
    assert len(every) == 192
    chain_gammas = {int(g) for g in str(sw.params["schedule.gamma"]).split(",")}
    policies = {}
    for name in ("lookahead", "disco"):
        for job in jobs(GridsSweeper(params=dict(sw.params), grids=grids, only=[name])):
            if job[-1] != "+validate=measure":
                continue
            exp = compose_exp("+sweep=validate", *job)
            policies[exp.lookahead.policy] = exp.schedule.gamma
            assert exp.sampling.temperature == 0.0 and exp.pair.name == "smollm2_135m+smollm2_draft"
    assert set(policies) == {"heuristic", "confidence", "oracle", "disco"}
    load = [compose_exp("+sweep=validate", *job) for job in jobs(GridsSweeper(params=dict(sw.params), grids=grids,
                                                                              only=["load"]))
            if job[-1] == "+validate=measure"]
    assert {(e.schedule.name, e.workload.concurrency) for e in load} == {(s, c) for s in ("sync", "ar") for c in (2, 4, 8)}
    assert set(policies.values()) <= chain_gammas
