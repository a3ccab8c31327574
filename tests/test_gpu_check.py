"""The GPU check (scripts/gpu_check.sh): its dry run on this CPU, end to end, and the wheels it
carries to a GPU machine that has no package registry."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# What the GPU machine's image has (docs/gpu.md): the distributions the check may rely on there
GPU_IMAGE = {
    "torch", "triton", "numpy", "pandas", "pyarrow", "seaborn", "matplotlib", "networkx", "psutil",
    "nvidia-ml-py", "safetensors", "tokenizers", "transformers", "jinja2", "rich", "tqdm", "pyyaml",
    "filelock", "cloudpickle", "markdown-it-py", "scipy", "joblib", "packaging", "typing-extensions",
    "pytest", "hypothesis", "accelerate", "sentencepiece", "requests", "pillow", "protobuf",
}
PROJECT = {"testbed", "sim", "real", "specbed_kernels", "scripts", "hydra_plugins", "tests", "benchmarks"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_list() -> set[str]:
    lines = (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    return {_norm(line.split("==")[0]) for line in lines if line.strip() and not line.startswith("#")}


def _third_party_imports() -> set[str]:
    """Top-level modules the project's runtime code imports (not its tests or benchmarks)."""
    names: set[str] = set()
    for pkg in ("testbed", "sim", "real", "specbed_kernels", "scripts", "hydra_plugins"):
        for f in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in PROJECT}


def test_wheels_cover_every_import_the_gpu_image_lacks() -> None:
    wheels = _wheel_list()
    dists = md.packages_distributions()
    missing = []
    for module in sorted(_third_party_imports()):
        owners = {_norm(d) for d in dists.get(module, [])}
        assert owners, f"import {module!r}: no installed distribution provides it"
        if not owners & (GPU_IMAGE | wheels):
            missing.append(f"{module} ({', '.join(sorted(owners))})")
    assert not missing, f"imported, not in the GPU image and not in scripts/gpu_wheels.txt: {missing}"
    # and what those wheels need in turn is there too (pip installs them with --no-deps)
    for dist in sorted(wheels):
        for line in md.requires(dist) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"python_version": "3.12", "extra": ""}):
                continue  # an extra, or for another Python
            name = _norm(req.name)
            assert name in GPU_IMAGE | wheels, f"{dist} requires {name}, which the GPU machine lacks"


def test_wheel_folder_matches_the_list_when_built() -> None:
    folder = REPO / ".gpu-wheels"
    if not folder.is_dir():
        pytest.skip("no .gpu-wheels/ here (`make gpu-wheels` builds it)")
    built = {_norm(w.name.split("-")[0]) for w in folder.glob("*.whl")}
    assert _wheel_list() <= built, f"`make gpu-wheels` again: missing {_wheel_list() - built}"


# The default run's dry run: `ar` and a chain run with its prediction (the pipeline's stage
# processes, trees and load are run by tests/real); every tiny run is the slow test's
QUICK_RUNS = ("sync g4",)


def _dry_run(tmp_path: Path, runs: tuple[str, ...]) -> dict:
    """`scripts/gpu_check.sh --device cpu --tiny --runs RUNS`: every run of it equals `ar` at
    temperature 0, each wrote telemetry, the k-token table and the summary files exist."""
    # budget 360 s: its real runs wait for the host lock while another real run holds it (the
    # other pytest-xdist worker's); a run the budget skips would fail the assert on the runs
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--tiny",
                           "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "360",
                           "--runs", *runs], cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")
    runs_done = {r["run"]: r for r in s["runs"]}
    assert set(runs_done) == {"ar", *runs}, (set(runs_done), s["skipped"])
    for name, r in runs_done.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["equal_ar"] is True, name
        assert r["tokens_per_s"] > 0 and r["telemetry"] is True, name
        # the summary is committed to docs/: its run folders are named within the check's work
        # folder, never by this machine's path
        assert r["run_dir"] == f"runs/{r['run'].replace(' ', '_').replace('=', '')}", r["run_dir"]
    assert all(0 < runs_done[n]["alpha"] <= 1 for n in runs)  # the draft is neither always right nor never
    assert runs_done["sync g4"]["sim_roofline_tokens_per_s"] > 0  # the simulator's prediction of it
    assert [r["k"] for r in s["forwards"]] == [1, 2, 4, 8, 16]
    assert all(r["eager_ms"] > 0 and r["roofline_ms"] > 0 for r in s["forwards"])
    assert all(step["ok"] for step in s["steps"]), s["steps"]
    assert s["all_equal_ar"] is True
    import tarfile

    with tarfile.open(out / "gpu_check_runs.tar.gz") as tar:  # the traces, for predictions elsewhere
        names = tar.getnames()
    assert {"runs/sync_g4/rounds.parquet", "runs/ar/requests.parquet"} <= set(names)
    assert not any(".hydra" in n for n in names)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"processes left behind: {left}"
    return s


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    s = _dry_run(tmp_path, QUICK_RUNS)
    # its predictions made again from the output folder alone (the GPU gone): the same numbers
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check_predict.py"), str(tmp_path / "out"),
                           "--out", str(tmp_path / "again")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = {r["run"]: r for r in json.loads((tmp_path / "again" / "gpu_check_predicted.json").read_text())["runs"]}
    first = {r["run"]: r for r in s["runs"]}
    assert again["sync g4"]["sim_roofline_tokens_per_s"] == first["sync g4"]["sim_roofline_tokens_per_s"]
    assert "sim_roofline_tokens_per_s" not in again["ar"]


def test_predictions_again_need_a_check_s_folder(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check_predict.py"), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.strip().count("\n") == 0 and "gpu_check.json" in proc.stdout


@pytest.mark.slow
def test_dry_run_of_every_tiny_run(tmp_path: Path) -> None:
    from scripts.gpu_check import TINY_RUNS

    assert set(QUICK_RUNS) <= set(TINY_RUNS)
    _dry_run(tmp_path, TINY_RUNS)


def test_missing_wheels_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Without hydra & co. and without wheels the script says what to do and exits 2."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")  # an interpreter where no import works
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHON": str(fake), "GPU_WHEELS": str(tmp_path / "none")},
                          timeout=30)
    assert proc.returncode == 2
    assert "make gpu-wheels" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_unknown_run_label_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """`--runs` names runs of the check; a label it does not have is refused before anything runs."""
    from scripts.gpu_check import RUNS, main

    assert main(["--device", "cpu", "--tiny", "--runs", "sync g4", "sync g5", "--out", "/nonexistent/x"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "sync g5" in out[0] and RUNS[0][0] in out[0]
