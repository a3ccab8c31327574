"""HumanEval pass@1 (testbed/humaneval_exec.py): generated code runs only in a sandboxed child
(timeout, resource limits, temporary cwd, no network), and `workload.exec_tests=true` puts
pass@1 into a real run's summary."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from testbed.app.preflight import PreflightError, preflight
from testbed.humaneval_exec import (
    Problem,
    pass_at_1,
    problems_by_id,
    run_problem,
    truncate_completion,
)
from testbed.workloads import load_prompts

ADD = Problem("t/add", "def add(a, b):\n", "def check(f):\n    assert f(1, 2) == 3\n", "add")


def test_correct_completion_passes_and_wrong_one_fails() -> None:
    assert run_problem(ADD, "    return a + b\n") == "passed"
    assert run_problem(ADD, "    return a - b\n") == "failed"
    assert run_problem(ADD, "    return a +\n") == "failed"  # a syntax error


def test_pass_at_1_is_the_share_of_passing_outputs() -> None:
    completions = {1: "    return a + b\n\ndef unrelated():\n    return 0 +\n", 2: "    return a * b\n"}
    outputs = [("t/add", [1]), ("t/add", [2])]
    assert pass_at_1({"t/add": ADD}, outputs, lambda ids: completions[ids[0]]) == 0.5
    assert pass_at_1({"t/add": ADD}, [], lambda ids: "") is None


def test_exiting_before_the_test_is_a_failure() -> None:
    assert run_problem(ADD, "    import sys\n    sys.exit(0)\nimport sys\nsys.exit(0)\n") == "failed"
    assert run_problem(ADD, "    return a + b\nimport os\nos._exit(0)\n") == "failed"


def test_an_infinite_loop_times_out_within_the_limit() -> None:
    start = time.monotonic()
    assert run_problem(ADD, "    while True:\n        pass\n", timeout_s=1.0) == "timeout"
    assert time.monotonic() - start < 3.0


def test_network_is_blocked() -> None:
    # a listener here: the kernel would queue a child's connection even before accept()
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        for completion in (f"    import socket\n    socket.create_connection(('127.0.0.1', {port}))\n"
                           "    return a + b\n",
                           "    import _socket\n    _socket.socket()\n    return a + b\n",
                           "    import socket\n    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                           "    return a + b\n"):
            assert run_problem(ADD, completion) == "failed"
        with pytest.raises(BlockingIOError):  # nothing connected
            server.accept()
    finally:
        server.close()


def test_nothing_runs_in_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    writes = "    open('written_by_completion', 'w').write('x')\n    return a + b\n"
    assert run_problem(ADD, writes) == "passed"  # it ran (in the child's temporary cwd) ...
    assert os.listdir(tmp_path) == []  # ... and left this cwd untouched
    marker = tmp_path / "marker"
    assert run_problem(ADD, f"    open({str(marker)!r}, 'w')\n    return a + b\n") == "passed"
    assert marker.exists() and "written_by_completion" not in os.listdir(tmp_path)


def test_truncation_and_the_real_problems_load() -> None:
    assert truncate_completion("    return 1\n\ndef other():\n    pass\n") == "    return 1\n"
    assert truncate_completion("    return 1") == "    return 1"
    problems = problems_by_id(load_prompts("humaneval"))
    assert len(problems) == 164
    p = problems["HumanEval/0"]
    assert p.entry_point == "has_close_elements" and "def check(candidate)" in p.test


@pytest.mark.parametrize("overrides", [
    ["workload=humaneval", "workload.exec_tests=true"],  # backend=sim: it executes nothing
    ["backend=real", "workload=mtbench", "workload.exec_tests=true"],
])
def test_exec_tests_without_effect_is_refused(overrides: list[str]) -> None:
    with pytest.raises(PreflightError) as e:
        preflight(overrides)
    assert "workload.exec_tests" in str(e.value) and "\n" not in str(e.value)


def test_exec_tests_must_be_a_bool() -> None:
    with pytest.raises(PreflightError) as e:
        preflight(["backend=real", "workload=humaneval", "workload.exec_tests=maybe"])
    assert "workload.exec_tests" in str(e.value)


def test_a_real_run_reports_pass_at_1(tmp_path: Path) -> None:
    from real.backend import run
    from testbed.results import write_run
    from tests.conftest import compose_exp
    from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=2)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=2, base=target, noise=0.02)
    exp = compose_exp("backend=real", "workload=humaneval", "workload.exec_tests=true",
                      f"pair.target.path={target}", f"pair.draft.path={draft}", "pair.target.layers=2",
                      "workload.num_prompts=2", "workload.max_new_tokens=6", "real.progress=false",
                      "real.threads=1", "schedule=sync", "schedule.gamma=2")
    summary = write_run(tmp_path / "run", exp, run(exp))
    assert 0.0 <= summary["pass_at_1"] <= 1.0 and 0.0 <= summary["pass_at_1_baseline"] <= 1.0
    from testbed.report import build_report

    md = build_report([tmp_path / "run"], tmp_path / "report").read_text()
    runs = md.split("## Runs", 1)[1].split("\n## ", 1)[0]
    assert "pass@1" in runs and "pass@1 ar" in runs  # beside tokens/s in the runs table
