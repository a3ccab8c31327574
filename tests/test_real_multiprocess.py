"""Multi-process real runs end to end (engine → runtime → tensor parallelism → schedule) on tiny
random-weight checkpoints: a placement on two cores spawns two workers, and every lossless
schedule gives the same tokens as the single-process run, with no process left behind."""

from __future__ import annotations

import psutil
import pytest

from real.engine import run
from tests.conftest import compose_exp
from tests.processes import live_workers
from tests.tiny_checkpoint import write_tiny_checkpoint

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
def test_tensor_parallel_run_equals_the_single_process_run(tiny_pair, schedule, allreduce) -> None:  # type: ignore[no-untyped-def]
    target, draft = tiny_pair
    common = ("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
              "workload.num_prompts=2", "workload.max_new_tokens=20", "real.ignore_eos=true",
              "real.progress=false", *schedule)
    one = run(compose_exp(*common))
    spec1, ar1 = _outputs(one)
    assert spec1 == ar1 and all(len(o) == 20 for o in spec1)  # lossless at temperature 0
    two = run(compose_exp(*common, "placement.target_gpus=2", "placement.draft_gpus=2",
                          f"real.allreduce={allreduce}"))
    assert two.extra["processes"] == 2
    for res in (one, two):  # the probe forwards, timed on the run's own devices before decoding
        assert res.extra["probe_target_s"] > 0 and res.extra["probe_draft_s"] > 0
        assert res.extra["probe_target_k8_s"] > res.extra["probe_target_s"] and res.extra["probe_draft_k8_s"] > 0
    assert _outputs(two) == (spec1, ar1)
    rounds = two.recorder.frames()[0]
    assert len(rounds) > 0 and (rounds.accepted <= rounds.drafted).all()
    assert live_workers() == []




@pytest.mark.slow
def test_torchrun_gives_the_tokens_of_the_spawned_run(tiny_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`torchrun --standalone --nproc-per-node 2 -m testbed ...` takes its ranks from torchrun;
    the same experiment spawned by `python -m testbed` generates the same tokens."""
    import os
    import shutil
    import subprocess
    import sys

    import pandas as pd

    target, draft = tiny_pair
    args = ["backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}", *TREE,
            "placement.target_gpus=2", "placement.draft_gpus=2", "workload.num_prompts=2",
            "workload.max_new_tokens=16", "real.ignore_eos=true", "real.progress=false",
            "report.per_run=false"]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    for cmd, out in (([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "testbed"], "trun"),
                     ([sys.executable, "-m", "testbed"], "spawn")):
        r = subprocess.run([*cmd, *args, f"hydra.run.dir={tmp_path / out}"], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    ids = [pd.read_parquet(tmp_path / d / "requests.parquet").output_ids.map(list).tolist()
           for d in ("trun", "spawn")]
    assert ids[0] == ids[1] and all(len(o) == 16 for o in ids[0])
    assert live_workers() == []
