"""The joblib launcher's pool, warmed during the pre-run check, is the pool the launcher uses."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf  # noqa: E402

from testbed.app import worker_pool  # noqa: E402


def _pid() -> int:
    return os.getpid()


def _preloaded() -> bool:
    import sys

    return all(m in sys.modules for m in ("sim.runtime.engine", "sim.schedules.async_tree", "torch", "seaborn"))


def _origin() -> tuple[int, int, int, int]:
    import gc

    import torch

    return os.getpid(), os.getppid(), torch.get_num_threads(), gc.get_freeze_count()


def test_other_launchers_are_not_warmed() -> None:
    basic = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    assert worker_pool.joblib_parallel_kwargs(basic) is None


@pytest.fixture
def fresh_pool(monkeypatch: pytest.MonkeyPatch):
    """A process without a warm pool, and loky's process-wide start method restored after."""
    from joblib.externals.loky.backend import context

    monkeypatch.setattr(worker_pool, "_thread", None)
    monkeypatch.setattr(worker_pool, "_kwargs", None)
    method = context.get_start_method()
    yield
    worker_pool.shutdown()
    context.set_start_method(method, force=True)


def test_launcher_reuses_the_warm_workers(fresh_pool: None) -> None:
    from joblib import Parallel, delayed

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
    import multiprocessing

    import psutil

    origins = Parallel(**cfg)(delayed(_origin)() for _ in range(4))
    if "forkserver" in multiprocessing.get_all_start_methods():
        # forked from one server that imported all once (not the test process, not spawned)
        servers = {ppid for _, ppid, *_ in origins}
        assert len(servers) == 1 and os.getpid() not in servers
        server = psutil.Process(servers.pop())
        assert server.ppid() == os.getpid()
        # each of the 2 workers gets its share of the cores for torch's pool, as loky's own
        cores = len(os.sched_getaffinity(0))
        assert {threads for _, _, threads, _ in origins} == {max(1, cores // 2)}
        # what the server imported is frozen: the workers' collections never walk (copy) it
        assert min(frozen for *_, frozen in origins) > 10_000
    worker_pool.shutdown()
    assert not [p for p in warm_pids if psutil.pid_exists(p)], "loky workers left running"
    assert not [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]


WAIT_IMPORTS = """
import sys
from omegaconf import OmegaConf
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from testbed.app import worker_pool
launcher = OmegaConf.structured(JobLibLauncherConf)
launcher.n_jobs = 2
before = {m for m in ("matplotlib", "testbed.report.sections", "testbed.report.sections_sim") if m in sys.modules}
assert worker_pool.warm(launcher)
worker_pool.wait()
import matplotlib
from joblib import Parallel, delayed
def autoload():
    import os
    return os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
env = Parallel(**worker_pool.parallel_kwargs(2))(delayed(autoload)() for _ in range(2))
worker_pool.shutdown()
print(sorted(before), matplotlib.get_backend(), "testbed.report.sections_sim" in sys.modules, env[0])
"""


def test_while_the_workers_warm_the_main_process_imports_what_the_report_needs() -> None:
    """The sweep report runs after the last job: its imports are done in the main process's idle
    wait for the fork server, not on the user's critical path."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    p = subprocess.run([sys.executable, "-c", WAIT_IMPORTS], cwd=root, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-2000:]
    before, backend, sections, autoload = p.stdout.split()[-4:]
    assert before == "[]"  # none imported by warm() itself: wait() did
    assert backend.lower() == "agg" and sections == "True"
    # simulated jobs load no out-of-tree torch device backends
    assert autoload == "0"


def _started_by(pid: int) -> list:
    """Live processes whose fork server was started by process ``pid`` (workers, the server)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and \
                    p.environ().get(worker_pool.SERVER_PARENT_ENV) == str(pid) and p.pid != pid:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private temporary directory with a short path: the fork server's socket is created in
    the TMPDIR the sweep gets, and a socket path stops at 107 bytes, which tmp_path under
    pytest-xdist (.../popen-gw0/<test name>/...) goes past."""
    path = Path(tempfile.mkdtemp(prefix="specbed-wp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_joblib_sweep_gives_the_basic_launchers_results_and_leaves_no_process(tmp_path, short_tmp) -> None:
    import subprocess
    import sys

    import pandas as pd

    from tests.conftest import ROOT

    grid = ["-m", "schedule.gamma=1,2,3", "workload.num_prompts=2", "workload.max_new_tokens=32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    tables = {}
    for launcher in ("basic", "joblib"):
        sweep, tmp = tmp_path / launcher, short_tmp / launcher
        tmp.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "testbed", *grid, f"hydra/launcher={launcher}",
                                 f"hydra.sweep.dir={sweep}"], cwd=ROOT, env={**env, "TMPDIR": str(tmp)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert not _started_by(proc.pid), "the sweep's fork server or workers outlived it"
        # the sweep leaves through os._exit: what it printed last was flushed first
        assert out.rstrip().splitlines()[-1] == f"sweep report: {sweep / 'report.html'}"
        assert not list(tmp.glob("specbed-joblib-*")), "the jobs' shared state was left behind"
        # ... and the exit handlers ran: joblib's shared-memory folders removed, loky's tracker quiet
        assert "leaked" not in err, err[-2000:]
        assert not list(Path("/dev/shm").glob(f"joblib_memmapping_folder_{proc.pid}_*"))
        tables[launcher] = pd.read_parquet(sweep / "results.parquet")
    assert len(tables["joblib"]) == 3 and set(tables["joblib"]["status"]) == {"ok"}
    cols = [c for c in tables["basic"].columns if c not in ("run_dir", "path", "job")]
    pd.testing.assert_frame_equal(tables["basic"][cols], tables["joblib"][cols])


def test_a_worker_loads_the_shared_job_state_once_per_launch(tmp_path, monkeypatch) -> None:
    """testbed.app.joblib_jobs: jobs carry only the path of the launch's shared state; a worker
    unpickles it and restores Hydra's singletons at its first job of that launch only."""
    import cloudpickle
    from hydra.core.singleton import Singleton

    from testbed.app import joblib_jobs

    restored = []
    monkeypatch.setattr(Singleton, "set_state", staticmethod(restored.append))
    monkeypatch.setattr(joblib_jobs, "_loaded", {})
    paths = []
    for launch in ("a", "b"):
        path = tmp_path / f"{launch}.pkl"
        path.write_bytes(cloudpickle.dumps((f"context {launch}", "config", len, f"singletons {launch}")))
        paths.append(str(path))
    assert joblib_jobs._shared_state(paths[0]) == ("context a", "config", len)
    os.unlink(paths[0])  # the later jobs of the launch do not read it again
    assert joblib_jobs._shared_state(paths[0]) == ("context a", "config", len)
    assert joblib_jobs._shared_state(paths[1])[0] == "context b"  # a later launch brings its own
    assert restored == ["singletons a", "singletons b"]


def test_only_the_joblib_launcher_is_given_the_shared_state_launch() -> None:
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher

    from testbed.app.joblib_jobs import SharedStateJoblibLauncher, with_shared_state

    basic = BasicLauncher()
    assert with_shared_state(basic) is basic
    joblib = JoblibLauncher(n_jobs=2)
    wrapped = with_shared_state(joblib)
    assert isinstance(wrapped, SharedStateJoblibLauncher) and wrapped.joblib == {"n_jobs": 2}


def test_seaborn_is_imported_without_scipy_and_scipy_still_works() -> None:
    """The report's seaborn leaves scipy.stats out (0.85 s of its import) and importable after."""
    import subprocess
    import sys

    code = ("import sys; from testbed.report.style import seaborn; sns = seaborn(); "
            "print('scipy.stats' in sys.modules, 'scipy.cluster' in sys.modules); "
            "import scipy.stats; print(scipy.stats.norm.cdf(0.0)); "
            "import seaborn._statistics as s; print(s._no_scipy, seaborn() is sns)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout.split()
    assert out == ["False", "False", "0.5", "True", "True"]
