"""The joblib launcher's pool, warmed during the pre-run check, is the pool the launcher uses."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf  # noqa: E402

from testbed import worker_pool  # noqa: E402


def _pid() -> int:
    return os.getpid()


def _preloaded() -> bool:
    import sys

    return all(m in sys.modules for m in ("sim.engine", "sim.schedules.async_tree", "torch", "seaborn"))


def test_other_launchers_are_not_warmed() -> None:
    basic = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    assert worker_pool.joblib_parallel_kwargs(basic) is None


def test_launcher_reuses_the_warm_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from joblib import Parallel, delayed

    monkeypatch.setattr(worker_pool, "_thread", None)
    monkeypatch.setattr(worker_pool, "_kwargs", None)
    launcher = OmegaConf.structured(JobLibLauncherConf)
    launcher.n_jobs = 2
    assert worker_pool.warm(launcher)
    worker_pool.wait()
    warm_pids = set(Parallel(**worker_pool.parallel_kwargs(2))(delayed(_pid)() for _ in range(8)))
    # what hydra_joblib_launcher passes to Parallel for the jobs (its _core.launch)
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg

    cfg = {k: v for k, v in OmegaConf.to_container(launcher).items() if k != "_target_"}
    cfg["backend"] = "loky"
    process_joblib_cfg(cfg)
    job_pids = set(Parallel(**cfg)(delayed(_pid)() for _ in range(8)))
    # the workers imported what a simulated job and the report need (sim's preload hook)
    assert all(Parallel(**cfg)(delayed(_preloaded)() for _ in range(4)))
    assert os.getpid() not in warm_pids
    assert job_pids <= warm_pids  # a different executor would have started new processes
    from joblib.externals.loky import get_reusable_executor

    get_reusable_executor().shutdown(wait=True)
    import psutil

    assert not [p for p in warm_pids if psutil.pid_exists(p)], "loky workers left running"
