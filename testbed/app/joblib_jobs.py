"""The joblib launcher's jobs, with the sweep's shared context shipped once per worker.

hydra_joblib_launcher sends every job its own copy of what all jobs share: the Hydra context
(config loader, callbacks), the sweep's config, the task function and Hydra's singletons. The
parent pickles them per job (~30 ms here) while the workers it feeds compete with it for the
same cores, and each worker unpickles them and re-runs Hydra's plugin scan
(``Singleton.set_state``) before every job: on 2 cores that was a third of a simulated `wan`
job's time in the workers. Here the shared part is pickled once, to a private file; a job
carries only its index and overrides, and a worker loads the shared part at its first job of
the launch and keeps it, as the basic launcher keeps its one process's state from job to job.
Everything else is the joblib launcher's: its ``Parallel`` settings, its log lines, its
``execute_job`` steps, one ``JobReturn`` per job in order.

GridsSweeper (hydra_plugins/specbed_sweeper) routes `hydra/launcher=joblib` here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_loaded: dict[str, tuple[Any, ...]] = {}  # worker: state file -> (context, config, task)


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
    """hydra_joblib_launcher's ``launch`` for ``launcher`` (a JoblibLauncher after setup)."""
    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log, filter_overrides, setup_globals
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg
    from joblib import Parallel, delayed

    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    joblib_cfg = dict(launcher.joblib)
    joblib_cfg["backend"] = "loky"  # as the launcher: threads do not work with Hydra
    process_joblib_cfg(joblib_cfg)
    log.info("Joblib.Parallel({}) is launching {} jobs".format(
        ",".join(f"{k}={v}" for k, v in joblib_cfg.items()), len(job_overrides)))
    log.info(f"Launching jobs, sweep output dir : {sweep_dir}")
    for idx, overrides in enumerate(job_overrides):
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")

    shared = cloudpickle.dumps((launcher.hydra_context, config, launcher.task_function,
                                Singleton.get_state()))
    fd, state_path = tempfile.mkstemp(prefix="specbed-joblib-", suffix=".pkl")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(shared)
        runs = Parallel(**joblib_cfg)(
            delayed(run_job_with_shared_state)(state_path, initial_job_idx + idx, list(overrides))
            for idx, overrides in enumerate(job_overrides))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(state_path)
    return list(runs)


def run_job_with_shared_state(state_path: str, idx: int, overrides: list[str]) -> Any:
    """One job in a worker: hydra_joblib_launcher's ``execute_job``, the shared state loaded at
    the worker's first job of this launch."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import run_job
    from omegaconf import open_dict

    hydra_context, config, task_function = _shared_state(state_path)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    return run_job(hydra_context=hydra_context, config=sweep_config, task_function=task_function,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def _shared_state(state_path: str) -> tuple[Any, ...]:
    state = _loaded.get(state_path)
    if state is None:
        import cloudpickle
        from hydra.core.singleton import Singleton
        from hydra.core.utils import setup_globals

        context, config, task_function, singletons = cloudpickle.loads(Path(state_path).read_bytes())
        setup_globals()
        Singleton.set_state(singletons)  # once per launch, as execute_job does before every job
        _loaded.clear()  # (a later launch, e.g. a test's next sweep, brings its own)
        state = _loaded[state_path] = (context, config, task_function)
    return state


class SharedStateJoblibLauncher:
    """A set-up hydra_joblib_launcher ``JoblibLauncher`` whose ``launch`` is the one above."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # config, joblib settings, setup: the launcher's
        return getattr(self.inner, name)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        return launch(self.inner, job_overrides, initial_job_idx)


def with_shared_state(launcher: Any) -> Any:
    """``launcher`` itself, or, for the joblib launcher, the launcher that ships the shared
    state once per worker (by class path: Hydra's plugin scan may re-create the class)."""
    from testbed.app.worker_pool import JOBLIB_LAUNCHER

    cls = type(launcher)
    return SharedStateJoblibLauncher(launcher) if f"{cls.__module__}.{cls.__qualname__}" == JOBLIB_LAUNCHER \
        else launcher
