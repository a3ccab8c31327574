"""real/runtime/launch.py: spawned workers on torch.distributed (gloo), emulated links, faults.

No model: tiny worker functions (tests/helpers/runtime_workers.py). Every test asserts that no worker
process is left behind.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from real.errors import WorkerFailed
from real.runtime.launch import launch, merge_records
from testbed.config import ExperimentConfig
from testbed.links import LinkDelays
from testbed.placement import make_placement
from tests.conftest import ROOT, compose_exp
from tests.helpers import runtime_workers as rw
from tests.helpers.processes import live_workers


def _real(*overrides: str) -> ExperimentConfig:
    """Composed on sim (the real schedule list is another module's business), run as real."""
    exp = compose_exp("hardware=local", "placement.target_gpus=1", "placement.draft_gpus=1",
                      "real.recv_timeout_s=20", *overrides)
    exp.backend = "real"
    return exp




@pytest.fixture(autouse=True)
def no_worker_left():  # type: ignore[no-untyped-def]
    yield
    assert live_workers() == []


def test_two_launches_at_once_round_trip_tp_broadcast_and_pinning() -> None:
    bridge = _real("schedule=async")
    tp = _real("schedule=sync", "placement.target_gpus=2", "placement.draft_gpus=2")
    with ThreadPoolExecutor(2) as pool:  # two jobs at once: separate rendezvous, no ports
        a, b = pool.map(lambda e: launch(e, rw.ping_pong, args=(3,), timeout_s=240), [bridge, tp])
    target, draft = (r.value for r in a)
    assert [r.role for r in a] == ["target", "draft"] and target["pid"] != draft["pid"]
    assert target["got"] == [[0, 1, 2, 3], [1, 2, 3, 4, 199_990_000.0], [2, 3, 4, 5]]
    assert draft["got"] == [[0, 10], [10, 20], [20, 30]]
    cpus = sorted(os.sched_getaffinity(0))
    assert [v["cpus"] for v in (target, draft)] == [[cpus[0]], [cpus[1 % len(cpus)]]]
    assert target["threads"] == draft["threads"] == 1
    rec = merge_records(a)
    assert len(rec.rounds) == 3 and [r[1] for r in rec.rounds] == [0, 1, 2]
    links = [s for s in rec.spans if s[1] == "link"]
    assert sorted({s[0] for s in links}) == ["link draft->target", "link target->draft"]
    assert len(links) == 6 and all(0 <= s[2] <= s[3] for s in links)
    # one group of two ranks: the leader's decision reaches both, the all-reduce sums ranks
    assert [r.value["decision"] for r in b] == [{"round0": 0}] * 2
    assert [r.value["sum"] for r in b] == [1.0, 1.0]


def test_emulated_wan_link_applies_the_shared_delay_model() -> None:
    exp = _real("schedule=decentralized", "placement.nodes=2", "network=wan", "seed=3")
    lk = make_placement(exp).link("stage0", "stage1")
    assert lk.emulated and lk.model.latency_s == pytest.approx(0.020)  # 20 ms, 1 Gb/s, 2 ms jitter
    n, nbytes = 40, 12_500  # 0.1 ms on the wire at 1 Gb/s
    res = launch(exp, rw.stream, args=(n, nbytes), timeout_s=240)
    measured = res[1].value
    # one message at a time (acked), so message i's modelled delay is exactly draw i
    model = LinkDelays(lk.model, exp.seed)
    expected = [model.model.serialization_s(nbytes) + model.propagation() for _ in range(n)]
    # handed over early only by the transport's measured one-way cost (well under 5 ms here)
    assert all(m >= e - 0.005 for m, e in zip(measured, expected))
    # loose: this machine is shared and noisy; the benchmark measures it properly
    assert abs(statistics.median(m - e for m, e in zip(measured, expected))) < 0.010
    assert statistics.mean(measured) == pytest.approx(lk.model.mean_s(nbytes), rel=0.5)


def test_a_raising_worker_ends_the_run_with_one_line() -> None:
    line = _failure_line(_real("schedule=async"), rw.fail, ("raise",))
    assert line == "rank 1 (draft) raised ValueError: boom in the draft"


CLI = """
import sys
import testbed.app.main as app
from real.runtime.launch import launch
from testbed.compose import register_configs
from tests.helpers.runtime_workers import fail
# the CLI's error path with a run whose draft worker is SIGKILLed mid-run
if __name__ == "__main__":
    stamp = sys.argv.pop()
    app.run_backend = lambda exp: launch(exp, fail, args=("kill", stamp))
    register_configs([])  # what `python -m testbed` does before Hydra composes
    app.main()
"""


def test_a_killed_worker_ends_the_cli_run_within_30_s_writing_nothing(tmp_path: Path) -> None:
    script, stamp, run_dir = tmp_path / "cli.py", tmp_path / "fault", tmp_path / "run"
    script.write_text(CLI)
    tmp = tmp_path / "tmp"  # the launcher's temporary directory (rendezvous), private to this test
    tmp.mkdir()
    r = subprocess.run([sys.executable, str(script), "schedule=async", "hardware=local",
                        "placement.target_gpus=1", "placement.draft_gpus=1", "report.per_run=false",
                        f"hydra.run.dir={run_dir}", str(stamp)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)},
                       capture_output=True,
                       text=True, timeout=300)
    ended = time.time()
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip() == "error: rank 1 (draft) died: killed by SIGKILL"
    assert ended - float(stamp.read_text()) < 30
    assert not (run_dir / "summary.json").exists()
    assert list(tmp.iterdir()) == []  # the rendezvous directory is gone


def _failure_line(exp: ExperimentConfig, fn: object, args: tuple = ()) -> str:
    with pytest.raises(WorkerFailed) as e:
        launch(exp, fn, args=args, timeout_s=240)  # type: ignore[arg-type]
    return str(e.value)


def test_a_hanging_worker_trips_the_receive_timeout() -> None:
    exp = _real("schedule=async", "real.recv_timeout_s=2")
    with ThreadPoolExecutor(2) as pool:  # in a receive, and after the other rank finished
        in_recv = pool.submit(_failure_line, exp, rw.fail, ("hang",))
        at_end = pool.submit(_failure_line, exp, rw.target_never_finishes)
    assert in_recv.result() == ("rank 0 (target) timed out: got no message from rank 1 (draft) on "
                                "channel bridge:draft<->target within 2 s (real.recv_timeout_s)")
    assert at_end.result() == ("rank 1 (draft) timed out: waited 2 s (real.recv_timeout_s) at the end "
                               "of the run for rank 0 (target)")


@pytest.mark.slow
def test_torchrun_uses_its_ranks_and_gathers_on_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "under_torchrun.py"
    script.write_text(TORCHRUN.replace("OUT_DIR", str(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    # a file per rank: the two processes' stdout interleave, lines included
    lines = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert lines == ["rank 0 writer=True results=[0, 1] got=[[0, 10], [10, 20], [20, 30]]",
                     "rank 1 writer=False results=[] got=None"]


TORCHRUN = """
import os
from tests.conftest import compose_exp
from real.runtime.launch import launch, is_writer
from tests.helpers.runtime_workers import ping_pong
exp = compose_exp("schedule=async", "hardware=local", "placement.target_gpus=1", "placement.draft_gpus=1")
exp.backend = "real"
res = launch(exp, ping_pong, args=(3,))
with open(os.path.join("OUT_DIR", f"rank{os.environ['RANK']}.txt"), "w") as f:
    f.write(f"rank {os.environ['RANK']} writer={is_writer()} results={[r.rank for r in res]} "
            f"got={res[1].value['got'] if res else None}")
"""


LAUNCHER = """
import sys
from tests.conftest import compose_exp
from real.runtime.launch import launch
from tests.helpers.runtime_workers import sleep_forever
if __name__ == "__main__":
    exp = compose_exp("hardware=local", "placement.target_gpus=2", "placement.draft_gpus=2")
    exp.backend = "real"
    try:
        launch(exp, sleep_forever)
    except KeyboardInterrupt:
        sys.exit(130)
"""


def test_ctrl_c_in_the_launcher_ends_every_worker(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # as from a shell: Ctrl-C's default action (a disposition of SIG_IGN would be inherited from
    # this process, and Python then never raises KeyboardInterrupt in the launcher)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        workers: list[psutil.Process] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            workers = [p for p in launcher.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert alive == []
    finally:
        proc.kill()
        proc.wait()


BARS = """
from tests.conftest import compose_exp
from real.runtime.launch import launch
from tests.helpers.runtime_workers import progress_bar
if __name__ == "__main__":
    exp = compose_exp("hardware=local", "placement.target_gpus=2", "placement.draft_gpus=2")
    exp.backend = "real"
    print(sorted(r.value for r in launch(exp, progress_bar, timeout_s=240)))
"""


def test_workers_that_draw_progress_bars_leave_no_semaphore_behind(tmp_path: Path) -> None:
    """tqdm's default lock is a multiprocessing semaphore that a worker leaving through os._exit
    never unlinks: the run ended with "leaked semaphore objects" warnings."""
    script = tmp_path / "bars.py"
    script.write_text(BARS)
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[0, 1]"
    assert "leaked semaphore" not in r.stderr, r.stderr[-2000:]
