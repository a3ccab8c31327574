"""The joblib launcher's worker processes, started while the pre-run check runs.

With `hydra/launcher=joblib`, Hydra starts its loky workers only when it launches the jobs, and
each worker then imports the app and the simulator before its first job (~2.5 s here, in which
a 2-core machine runs nothing). `python -m testbed` knows the launcher from the check's first
composition, so it starts the very same pool (joblib's reusable executor: same arguments as
hydra_joblib_launcher passes to ``Parallel``, so the launcher reuses it rather than replacing
it) in a background thread and has every worker import what a job and the report need, while
the main process checks the jobs. The sweep report draws its figures in the same warm workers.

Where the platform has one, the workers are forked from a fork server that imported all that
once (loky's ``forkserver`` start method with `testbed.app.worker_imports` preloaded): on 2 cores
the workers' own imports (~3.6 s of CPU each, torch included) were what kept a joblib sweep
from running its jobs twice as fast as the basic launcher. When the sweep is over its workers
are killed rather than asked to tear down torch (~1 s) while the user waits.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any

JOBLIB_LAUNCHER = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"

_kwargs: dict[str, Any] | None = None  # the launcher's Parallel arguments, once warmed
_thread: threading.Thread | None = None
JOB_MODULES = ("testbed.app.main", "testbed.report")  # what every job and its report import
BACKEND_ENV = "SPECBED_WORKER_BACKEND"  # the backend whose job modules the fork server imports
SERVER_PARENT_ENV = "SPECBED_FORK_SERVER_PARENT"  # pid of the process that starts the server
THREADS_ENV = "SPECBED_WORKER_THREADS"  # each worker's share of the cores
_server_started = False


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


def import_job_modules(backend: str) -> None:
    """The imports of a job of ``backend`` and of the report's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    from testbed.report.style import seaborn

    seaborn()  # (without scipy: see there)

    # by name: a preload, not a dependency (the app and the report use this module)
    for module in JOB_MODULES:
        importlib.import_module(module)
    from testbed import backends

    preload = backends.get(backend).preload
    if preload is not None:
        preload()


def _warm_worker(backend: str) -> int:
    """Runs in a worker (a no-op when it was forked from the fork server, which imported all)."""
    import os

    import_job_modules(backend)
    return os.getpid()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_fork_server_for(args: list[str]) -> bool:
    """`start_fork_server` from a command line that names the joblib launcher, first thing: the
    server's imports (~3 s) then run while this process imports and checks the jobs."""
    value = dict(a.split("=", 1) for a in args if "=" in a)
    try:
        n_jobs = int(value.get("hydra.launcher.n_jobs", "-1"))
    except ValueError:
        n_jobs = -1  # the check names the bad value; this is only a head start
    workers = n_jobs if n_jobs > 0 else max(1, _cores() + 1 + n_jobs)  # joblib's -1: every core
    return start_fork_server(value.get("backend", "sim"), workers)


def start_fork_server(backend: str, workers: int) -> bool:
    """Start the fork server the ``workers`` will come from, importing a ``backend`` job's modules
    (False where the platform has none). Cheap for the caller: the server imports, not it."""
    import multiprocessing
    import os
    from multiprocessing import forkserver

    global _server_started
    if _server_started:
        return True
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    os.environ[BACKEND_ENV] = backend  # read by testbed.app.worker_imports in the server
    os.environ[SERVER_PARENT_ENV] = str(os.getpid())
    # loky gives the workers it spawns a share of the cores for their thread pools; forked
    # ones inherit the server's, which must be set before it imports torch
    os.environ[THREADS_ENV] = str(max(1, _cores() // max(1, workers)))
    multiprocessing.set_forkserver_preload(["testbed.app.worker_imports"])
    forkserver.ensure_running()
    _server_started = True
    return True


def _use_fork_server(backend: str, workers: int) -> None:
    """loky's workers of this process come from the fork server (started now if not yet)."""
    from joblib.externals.loky.backend import context

    if "forkserver" not in context.START_METHODS or context.get_start_method() is not None:
        return  # no fork server here, or a start method chosen already (it is process-wide)
    if start_fork_server(backend, workers):
        context.set_start_method("forkserver")


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
    _use_fork_server(backend, n)

    def run() -> None:
        # warming is an optimisation: if it fails, the launcher starts its workers itself
        with contextlib.suppress(Exception):
            Parallel(**quiet)(delayed(_warm_worker)(backend) for _ in range(n))

    _kwargs = kwargs
    _thread = threading.Thread(target=run, name="warm-joblib-workers", daemon=True)
    _thread.start()
    return True


def wait() -> None:
    """Block until the warm-up has finished (before the launcher uses the pool). Meanwhile this
    process imports what its share of the sweep report needs (matplotlib, the report's sections,
    ~0.2-0.4 s): its core is otherwise idle while the fork server imports, and the report comes
    after the last job, on the user's critical path."""
    if _thread is None:
        return
    if _thread.is_alive():
        with contextlib.suppress(Exception):  # an optimisation: the report imports them anyway
            _import_report_modules()
    _thread.join()


def _import_report_modules() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import markdown_it  # noqa: F401  (report.html)

    # by name, as JOB_MODULES: the report uses this module's pool
    importlib.import_module("testbed.report").load_sections([])


def parallel_kwargs(n_jobs: int) -> dict[str, Any]:
    """``Parallel`` arguments for other work of the sweep (the report): the warm pool's when there
    is one (other arguments would make joblib replace its executor), else ``n_jobs`` loky workers."""
    if _kwargs is not None:
        return {**_kwargs, "verbose": 0}
    return {"n_jobs": n_jobs, "backend": "loky"}


def shutdown() -> None:
    """Kill this process's loky workers (the sweep's jobs and report are done) instead of
    waiting at exit while each tears down what it imported, and stop the fork server."""
    import multiprocessing.forkserver
    import os
    import signal
    import sys

    global _server_started
    reusable_executor = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(reusable_executor, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)
    server = multiprocessing.forkserver._forkserver
    if _server_started and getattr(server, "_forkserver_pid", None):
        # killed, not asked: it may still be importing (a check that failed at once), and it
        # only reads its "parent gone" pipe after that; a later pool starts it again
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        getattr(server, "_stop", lambda: None)()  # (CPython's own: closes its pipes, reaps it)
    _server_started = False
