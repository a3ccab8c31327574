"""The joblib launcher's worker processes, started while the pre-run check runs.

With `hydra/launcher=joblib`, Hydra starts its loky workers only when it launches the jobs, and
each worker then imports the app and the simulator before its first job (~2.5 s here, in which
a 2-core machine runs nothing). `python -m testbed` knows the launcher from the check's first
composition, so it starts the very same pool (joblib's reusable executor: same arguments as
hydra_joblib_launcher passes to ``Parallel``, so the launcher reuses it rather than replacing
it) in a background thread and has every worker import what a job and the report need, while
the main process checks the jobs. The sweep report draws its figures in the same warm workers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"

_kwargs: dict[str, Any] | None = None  # the launcher's Parallel arguments, once warmed
_thread: threading.Thread | None = None


def joblib_parallel_kwargs(launcher_cfg: Any) -> dict[str, Any] | None:
    """``Parallel`` arguments exactly as hydra_joblib_launcher builds them (None: another launcher)."""
    from omegaconf import OmegaConf

    if launcher_cfg is None or launcher_cfg.get("_target_") != JOBLIB_LAUNCHER:
        return None  # (other launchers' settings may hold interpolations only Hydra resolves)
    try:
        cfg = dict(launcher_cfg) if isinstance(launcher_cfg, dict) else OmegaConf.to_container(launcher_cfg, resolve=True)
    except Exception:  # noqa: BLE001 — an unresolvable setting: the launcher reports it itself
        return None
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg

    kwargs = {k: v for k, v in cfg.items() if k != "_target_"}
    kwargs["backend"] = "loky"  # as the launcher: its backend is hard-coded to loky
    process_joblib_cfg(kwargs)
    return kwargs


def _warm_worker(backend: str) -> int:
    """Runs in a worker: the imports of a job of ``backend`` and of the report's figures."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import seaborn  # noqa: F401

    import testbed.app  # noqa: F401
    import testbed.report  # noqa: F401
    from testbed import backends

    preload = backends.get(backend).preload
    if preload is not None:
        preload()
    return os.getpid()


def warm(launcher_cfg: Any, backend: str = "sim") -> bool:
    """Start the joblib launcher's workers in the background, each importing what a ``backend``
    job needs (no-op for other launchers)."""
    global _kwargs, _thread
    kwargs = joblib_parallel_kwargs(launcher_cfg)
    if kwargs is None or _thread is not None:
        return False
    from joblib import Parallel, delayed, effective_n_jobs

    n = effective_n_jobs(kwargs.get("n_jobs", -1))
    quiet = {**kwargs, "verbose": 0}

    def run() -> None:
        # warming is an optimisation: if it fails, the launcher starts its workers itself
        with contextlib.suppress(Exception):
            Parallel(**quiet)(delayed(_warm_worker)(backend) for _ in range(n))

    _kwargs = kwargs
    _thread = threading.Thread(target=run, name="warm-joblib-workers", daemon=True)
    _thread.start()
    return True


def wait() -> None:
    """Block until the warm-up has finished (before the launcher uses the pool)."""
    if _thread is not None:
        _thread.join()


def parallel_kwargs(n_jobs: int) -> dict[str, Any]:
    """``Parallel`` arguments for other work of the sweep (the report): the warm pool's when there
    is one (other arguments would make joblib replace its executor), else ``n_jobs`` loky workers."""
    if _kwargs is not None:
        return {**_kwargs, "verbose": 0}
    return {"n_jobs": n_jobs, "backend": "loky"}
