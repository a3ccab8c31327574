"""testbed.app.sweep_configs.GroupCachedConfigLoader: a sweep job's configuration, composed once per
set of group choices, must be exactly what Hydra composes for that job."""

from __future__ import annotations

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from hydra_plugins.specbed_sweeper.grids_sweeper import GridsSweeper
from testbed.app.preflight import command_pairs
from testbed.app.sweep_configs import GroupCachedConfigLoader
from testbed.compose import register_configs
from tests.conftest import CONF


def master_and_jobs(*args: str) -> tuple[ConfigLoaderImpl, object, list[list[str]]]:
    """The multirun's master config and its jobs' overrides, as `python -m testbed ARGS` has them."""
    register_configs(command_pairs(list(args)))
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    master = loader.load_configuration(config_name="config", overrides=list(args), run_mode=RunMode.MULTIRUN)
    sw = OmegaConf.to_container(master.hydra.sweeper, resolve=True)
    sweeper = GridsSweeper(params=sw.get("params") or {}, grids=sw.get("grids") or {}, only=sw.get("only"))
    cli = [a for a in args if "=" in a and not a.startswith("hydra")]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(
        [f"{k}={v}" for k, v in sweeper.params.items()] + cli)
    jobs = [job for batch in sweeper.split_arguments(parsed, None) for job in batch]
    return loader, master, jobs


@pytest.mark.parametrize("args", [("+sweep=wan",), ("+sweep=gpu_split",),
                                  ("+sweep=wan", "backend=real"),
                                  ("+sweep=validate",)])
def test_every_job_of_a_bundled_sweep_is_composed_as_hydra_composes_it(args: tuple[str, ...]) -> None:
    loader, master, jobs = master_and_jobs(*args)
    cached = GroupCachedConfigLoader(loader)
    assert len(jobs) >= 12
    for job in jobs[:: len(jobs) // 6]:  # 6-7 jobs a sweep, across its grids (Hydra's own: 0.1 s each)
        want = ConfigLoaderImpl.load_sweep_config(loader, master, list(job))
        got = cached.load_sweep_config(master, list(job))
        assert OmegaConf.to_container(got, resolve=False) == OmegaConf.to_container(want, resolve=False), job
        assert OmegaConf.is_struct(got) and not OmegaConf.is_readonly(got.hydra)
        assert got.hydra.job.override_dirname == want.hydra.job.override_dirname


def test_jobs_that_differ_only_in_values_share_one_composition(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    loader, master, jobs = master_and_jobs("+sweep=wan")
    calls: list[list[str]] = []
    real = ConfigLoaderImpl.load_sweep_config
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config",
                        lambda self, m, o: calls.append(list(o)) or real(self, m, o))
    cached = GroupCachedConfigLoader(loader)
    cfgs = [cached.load_sweep_config(master, list(job)) for job in jobs]
    assert len(jobs) == 60 and len(calls) == 1  # one set of group choices: one composition
    assert len({(c.placement.nodes, c.network.latency_ms, c.schedule.tau) for c in cfgs}) == 60
    cfgs[0].schedule.tau = 0.9  # each job has its own copy
    assert cached.load_sweep_config(master, list(jobs[0])).schedule.tau == 0.0
    # another sweep in the same process does not reuse this one's compositions
    GroupCachedConfigLoader(loader).load_sweep_config(master, list(jobs[0]))
    assert len(calls) == 2


def test_additions_deletions_and_bad_values_go_to_hydra(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    loader, master, jobs = master_and_jobs("+sweep=wan")
    cached = GroupCachedConfigLoader(loader)
    calls: list[list[str]] = []
    real = ConfigLoaderImpl.load_sweep_config
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config",
                        lambda self, m, o: calls.append(list(o)) or real(self, m, o))
    job = [*jobs[0], "+workload.extra_key=1"]
    got = cached.load_sweep_config(master, job)
    assert calls == [job] and got.workload.extra_key == 1  # composed by Hydra, as given
    with pytest.raises(Exception, match="latency_ms"):
        cached.load_sweep_config(master, [*jobs[1][:-1], "network.latency_ms=fast"])
