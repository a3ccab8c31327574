"""Multi-process real runs end to end (engine → runtime → tensor parallelism → schedule) on tiny
random-weight checkpoints: a placement on two cores spawns two workers, and every lossless
schedule gives the same tokens as the single-process run, with no process left behind."""

from __future__ import annotations

import psutil
import pytest

from real.runtime.engine import run
from tests.conftest import compose_exp
from tests.helpers.processes import assert_promised_files, live_descendants, live_workers
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2,
                                reason="needs two cores (one worker per core)")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_checkpoint(root / "target", seed=1, layers=3)
    draft = write_tiny_checkpoint(root / "draft", seed=2, layers=3, base=target, noise=0.3)
    return target, draft


def _outputs(result) -> tuple[list[list[int]], list[list[int]]]:  # type: ignore[no-untyped-def]
    return ([r["output_ids"] for r in result.recorder.requests],
            [r["output_ids"] for r in result.baseline.requests])


SYNC = ("schedule=sync", "schedule.gamma=3")
TREE = ("schedule=sync", "schedule.tree=true", "schedule.tree_width=3", "schedule.tree_budget=6",
        "schedule.tree_depth=2")


@pytest.mark.parametrize(("schedule", "allreduce"), [
    (TREE, "shm"),
    pytest.param(SYNC, "shm", marks=pytest.mark.slow),
    pytest.param(TREE, "gloo", marks=pytest.mark.slow)])
def test_tensor_parallel_run_equals_the_single_process_run(tiny_pair, schedule, allreduce, tmp_path) -> None:  # type: ignore[no-untyped-def]
    target, draft = tiny_pair
    common = ("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
              "workload.num_prompts=2", "workload.max_new_tokens=20", "real.ignore_eos=true",
              "real.progress=false", *schedule)
    one = run(compose_exp(*common))
    spec1, ar1 = _outputs(one)
    assert spec1 == ar1 and all(len(o) == 20 for o in spec1)  # lossless at temperature 0
    exp2 = compose_exp(*common, "placement.target_gpus=2", "placement.draft_gpus=2",
                       f"real.allreduce={allreduce}")
    two = run(exp2)
    assert two.extra["processes"] == 2
    assert_promised_files(tmp_path, exp2, two)
    for res in (one, two):  # the probe forwards, timed on the run's own devices before decoding
        assert res.extra["probe_target_s"] > 0 and res.extra["probe_draft_s"] > 0
        # both probes ran (their order is a timing, which a busy core can swap on a tiny model)
        assert res.extra["probe_target_k8_s"] > 0 and res.extra["probe_draft_k8_s"] > 0
    assert _outputs(two) == (spec1, ar1)
    rounds = two.recorder.frames()[0]
    assert len(rounds) > 0 and (rounds.accepted <= rounds.drafted).all()
    assert live_workers() == []



@pytest.mark.parametrize("schedule", [SYNC, TREE, pytest.param(("schedule=ar",), marks=pytest.mark.slow)])
def test_tensor_parallel_under_load_equals_the_single_process_run(tiny_pair, schedule) -> None:  # type: ignore[no-untyped-def]
    """Three clients on a TP 2 group: its leader admits and tells the other rank, both serve the
    same batched rounds (the native batched kernel all-reducing between layers; the serial tree's
    per-request threads meet in the same batched forwards on both ranks); every request's answer
    is the single-process `ar` answer, on the leader and on the other rank."""
    target, draft = tiny_pair
    common = ("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
              "workload.num_prompts=4", "workload.max_new_tokens=16", "real.ignore_eos=true",
              "real.progress=false")
    alone = {r["request_id"]: r["output_ids"] for r in run(compose_exp(*common, "schedule=ar")).recorder.requests}
    two = run(compose_exp(*common, *schedule, "workload.concurrency=3", "placement.target_gpus=2",
                          "placement.draft_gpus=2"))  # (the ranks' outputs are compared in the run)
    assert two.extra["processes"] == 2
    assert {r["request_id"]: r["output_ids"] for r in two.recorder.requests} == alone
    _, requests, timeline = two.recorder.frames()
    assert timeline["batch"].max() == 3 and requests.arrival_s.notna().all()
    assert live_workers() == []


def _cli_runs(runs: dict[str, list[list[str]]], args: list[str], tmp_path) -> dict[str, list[list[int]]]:  # type: ignore[no-untyped-def]
    """Each named run: its commands started together (the nodes of one torchrun job), each with
    ``args`` and the run's own ``hydra.run.dir``; the output_ids of its requests.parquet."""
    import os
    import subprocess

    import pandas as pd

    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = {}
    for name, cmds in runs.items():
        procs = [subprocess.Popen([*cmd, *args, f"hydra.run.dir={tmp_path / name}"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for cmd in cmds]
        for p in procs:
            try:
                _, err = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            assert p.returncode == 0, f"{name}: {err[-3000:]}"
        out[name] = pd.read_parquet(tmp_path / name / "requests.parquet").output_ids.map(list).tolist()
    assert live_descendants(before) == []
    return out


def _torchrun() -> str:
    import os
    import shutil
    import sys

    return shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"


SMALL = ("workload.num_prompts=2", "workload.max_new_tokens=16", "real.ignore_eos=true",
         "real.progress=false", "report.per_run=false")


@pytest.mark.slow
def test_the_readme_torchrun_command_gives_the_tokens_of_the_spawned_run(tiny_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README's `torchrun --standalone --nproc-per-node 2 -m testbed backend=real
    placement.target_gpus=2 placement.draft_gpus=2 hydra.run.dir=DIR`: both ranks run (they
    share the host's one-real-job lock instead of waiting on each other), and the same
    experiment spawned by `python -m testbed` generates the same tokens; no process is left."""
    import sys

    target, draft = tiny_pair
    args = ["backend=real", "placement.target_gpus=2", "placement.draft_gpus=2",
            f"pair.target.path={target}", f"pair.draft.path={draft}", *SMALL]
    ids = _cli_runs({"trun": [[_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "testbed"]],
                     "spawn": [[sys.executable, "-m", "testbed"]]}, args, tmp_path)
    assert ids["trun"] == ids["spawn"] and all(len(o) == 16 for o in ids["trun"])


@pytest.mark.slow
def test_async_across_two_torchrun_nodes_gives_the_tokens_of_the_spawned_run(tiny_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README says the torchrun command spans machines: two launches the way a cluster runs
    them (`--nnodes 2 --node-rank {0,1}`, c10d rendezvous on a free port), one rank each, run the
    async layout (draft on one node, target on the other) with the spawned run's tokens."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target, draft = tiny_pair
    args = ["backend=real", "schedule=async", "schedule.tree_width=3", "schedule.tree_budget=6",
            f"pair.target.path={target}", f"pair.draft.path={draft}", *SMALL]
    nodes = [[_torchrun(), "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "testbed"]
             for n in (0, 1)]
    ids = _cli_runs({"nodes": nodes, "spawn": [[sys.executable, "-m", "testbed"]]}, args, tmp_path)
    assert ids["nodes"] == ids["spawn"] and all(len(o) == 16 for o in ids["nodes"])
