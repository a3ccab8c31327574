"""A schedule added from outside the repository: a plug-in package in a temporary directory —
its declaration (``__init__.py``: one ``ScheduleSpec``), one file per backend and one conf file —
runs on both backends through the command line without any file of the repository changing.

The toy schedule is a copy of ``sync`` under another name: simulated, it gives sync's summary
field for field; executed on tiny checkpoints at temperature 0, the tokens of its `ar` baseline.
The plug-in is loaded the way a user loads one: ``SPECBED_PLUGINS=toy_schedule`` with the
package on ``PYTHONPATH``; its conf directory joins Hydra's search path by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]

DECLARATION = '''"""A toy schedule: sync under another name (a plug-in of specbed)."""
from pathlib import Path

from testbed.schedules import SINGLE, ScheduleSpec, register

register(ScheduleSpec(
    "toy", SINGLE, "a copy of sync", reads=frozenset({"schedule.gamma", "lookahead"}),
    replays=("sync",), trace_from="sync", color="#CC79A7",
    modules={"sim": "toy_schedule.sim", "real": "toy_schedule.real"},
    conf_dir=str(Path(__file__).parent / "conf")))
'''


def write_plugin(root: Path) -> Path:
    """toy_schedule/: the declaration, sim.py and real.py (copies of the sync files registering
    ``toy``) and conf/schedule/toy.yaml."""
    pkg = root / "toy_schedule"
    (pkg / "conf" / "schedule").mkdir(parents=True)
    (pkg / "__init__.py").write_text(DECLARATION)
    for backend in ("sim", "real"):
        source = (ROOT / backend / "schedules" / "sync.py").read_text()
        assert source.count('@register("sync")') == 1
        (pkg / f"{backend}.py").write_text(source.replace('@register("sync")', '@register("toy")'))
    (pkg / "conf" / "schedule" / "toy.yaml").write_text("name: toy\ngamma: 3\n")
    return pkg


def run_cli(root: Path, *args: str, plugins: str = "toy_schedule") -> subprocess.CompletedProcess:
    """``python -m testbed ARGS`` with the plug-in loaded as a user loads one: its package's
    directory on PYTHONPATH, its name in SPECBED_PLUGINS."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "SPECBED_PLUGINS": plugins,
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def cli(root: Path, *args: str) -> None:
    done = run_cli(root, *args)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_toy_schedule_from_a_plugin_package_runs_on_both_backends(tmp_path) -> None:  # type: ignore[no-untyped-def]
    before = {p: p.stat().st_mtime_ns for d in ("testbed", "sim", "real", "conf") for p in (ROOT / d).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    write_plugin(tmp_path / "plugins")
    small = ("workload.num_prompts=2", "workload.max_new_tokens=16", "report.per_run=false")
    # the simulator: the copy of sync gives sync's summary, field for field (the same seeds)
    cli(tmp_path / "plugins", "schedule=toy", *small, f"hydra.run.dir={tmp_path / 'sim_toy'}")
    cli(tmp_path / "plugins", "schedule=sync", "schedule.gamma=3", *small, f"hydra.run.dir={tmp_path / 'sim_sync'}")
    toy = json.loads((tmp_path / "sim_toy" / "summary.json").read_text())
    sync = json.loads((tmp_path / "sim_sync" / "summary.json").read_text())
    assert toy.pop("schedule") == "toy" and sync.pop("schedule") == "sync"
    assert toy == sync and toy["gamma"] == 3 and toy["speedup"] > 1
    # the real backend on tiny checkpoints: temperature 0 is the `ar` baseline token for token
    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=3)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=3, base=target)  # the target's twin
    run = tmp_path / "real_toy"
    cli(tmp_path / "plugins", "backend=real", "schedule=toy", f"pair.target.path={target}",
        f"pair.draft.path={draft}", "real.ignore_eos=true", "real.progress=false", *small,
        f"hydra.run.dir={run}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["schedule"] == "toy" and summary["backend"] == "real" and summary["gamma"] == 3
    out = pd.read_parquet(run / "requests.parquet").sort_values("request_id").output_ids.map(list).tolist()
    ar = pd.read_parquet(run / "baseline_requests.parquet").sort_values("request_id").output_ids.map(list).tolist()
    assert out == ar and all(len(o) == 16 for o in out)
    # the draft (the target's weights) proposed γ guesses a round and the target kept them
    assert summary["drafted_tokens"] > 0 and summary["mean_accepted_len"] > 2
    after = {p: p.stat().st_mtime_ns for p in before if p.exists()}
    assert after == before  # no file of the repository was touched


def test_an_unknown_plugin_schedule_or_package_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "plugins"
    write_plugin(root)
    done = run_cli(root, "schedule=tyo")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: schedule=tyo is not allowed: one of ar, async, decentralized, sync, toy; did you mean toy?"]
    done = run_cli(root, plugins="toy_schedul")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: SPECBED_PLUGINS='toy_schedul' is not allowed: an importable schedule plug-in package "
        "(No module named 'toy_schedul'); put its directory on PYTHONPATH or remove it from SPECBED_PLUGINS"]


LOADED_IN_CODE = '''
import os, subprocess, sys
from testbed.schedules import load_plugin
assert "SPECBED_PLUGINS" not in os.environ
load_plugin("toy_schedule")
print(os.environ["SPECBED_PLUGINS"])
child = "from testbed.schedules import specs; print(','.join(s.name for s in specs()))"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
'''


def test_a_plugin_loaded_in_code_reaches_the_processes_it_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``load_plugin`` (from code, not the environment) names the plug-in in SPECBED_PLUGINS, so
    the workers and ranks a run spawns register its schedule too."""
    write_plugin(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "SPECBED_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", LOADED_IN_CODE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    named, child_schedules = p.stdout.split()
    assert named == "toy_schedule"
    assert "toy" in child_schedules.split(",") and "sync" in child_schedules.split(",")
