"""HumanEval pass@1 by executing the problems' tests on a run's generated code (opt-in:
``workload.exec_tests=true``, backend=real).

Generated code is untrusted: it never runs in this process. Each problem runs
``prompt + completion + test + check(entry_point)`` in a fresh ``python -I`` child (isolated:
no user site, no PYTHON* environment, no cwd on sys.path) in its own session, inside an empty
temporary directory that is removed afterwards, and with:

- a wall-clock timeout (the whole process group is killed when it passes),
- resource limits (address space, CPU seconds, file size, core dumps) that the child sets on
  itself, hard and soft, before the program runs — in the child rather than in a
  ``preexec_fn``, which is unsafe in a parent with threads (torch's),
- no network: ``socket.socket`` (and ``_socket``'s) become a class whose construction raises,
  and ``socketpair``/``fromfd``/``create_connection``/``create_server`` raise. This is a
  Python-level guard (Python 3.11 has no ``os.unshare`` for a network namespace): it stops
  generated code from opening sockets, not a deliberate attacker using ctypes.

A problem passes only if the program ran to its end: the child's runner writes a per-run
random token to a private copy of stdout after the program returns (the program's own stdout
goes to /dev/null), so an early ``sys.exit(0)`` or ``os._exit(0)`` in a completion is a failure.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Outcome = Literal["passed", "failed", "timeout"]
DEFAULT_TIMEOUT_S = 5.0
MEMORY_LIMIT_BYTES = 2 << 30  # address space: CPython needs ~50 MB, tests need a little more
FILE_SIZE_LIMIT_BYTES = 16 << 20
# Codex (Chen et al. 2021) stops a completion at the first of these: what follows the function
# body is another top-level statement the test does not need (and may break it).
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

# The child's runner: the first stdin line is the token, the rest is the program. Limits and the
# network guard are in place before the program is compiled.
_RUNNER = r"""
import os, resource, socket, _socket, sys
token = sys.stdin.readline().strip()
source = sys.stdin.read()
mem, cpu, fsize = (int(x) for x in sys.argv[1:4])
for lim, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                   (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (value, value))

def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in specbed's HumanEval executor")

class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()

for mod in (socket, _socket):
    mod.socket = mod.SocketType = _NoSocket
    mod.socketpair = mod.fromfd = _no_network
socket.create_connection = socket.create_server = _no_network
report = os.dup(1)
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
exec(compile(source, "<humaneval>", "exec"), {"__name__": "__main__"})
os.write(report, token.encode())
"""


@dataclass(frozen=True)
class Problem:
    """What executing one HumanEval problem needs (its row's prompt and ``meta``)."""

    task_id: str
    prompt: str
    test: str
    entry_point: str


def truncate_completion(completion: str) -> str:
    """The completion up to the first stop sequence (STOP_SEQUENCES)."""
    cut = min((i for i in (completion.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(completion))
    return completion[:cut]


def program(problem: Problem, completion: str) -> str:
    return (f"{problem.prompt}{completion}\n\n{problem.test}\n\n"
            f"check({problem.entry_point})\n")


def run_problem(problem: Problem, completion: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """Execute one problem's test on `completion` in a sandboxed child process."""
    token = secrets.token_hex(16)
    cpu_s = int(timeout_s) + 1
    with tempfile.TemporaryDirectory(prefix="specbed-humaneval-") as cwd:
        child = subprocess.Popen(
            [sys.executable, "-I", "-c", _RUNNER, str(MEMORY_LIMIT_BYTES), str(cpu_s),
             str(FILE_SIZE_LIMIT_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=cwd, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            start_new_session=True)  # its own process group: a timeout kills what it spawned
        try:
            out, _ = child.communicate(f"{token}\n{program(problem, completion)}".encode(),
                                       timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            child.communicate()
            return "timeout"
        finally:
            _kill_group(child.pid)  # anything the program left running in the background
    return "passed" if child.returncode == 0 and out == token.encode() else "failed"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def problems_by_id(prompts: Iterable[Any]) -> dict[str, Problem]:
    """testbed.workloads.Prompt rows of HumanEval -> Problem, by id. A row without ``test`` in
    its meta comes from an old data file: regenerate it."""
    out = {}
    for p in prompts:
        if "test" not in p.meta or "entry_point" not in p.meta:
            raise ValueError(f"{p.id}: no test in data/humaneval.jsonl; regenerate it with "
                             "`python scripts/extract_workloads.py`")
        out[p.id] = Problem(p.id, p.text, p.meta["test"], p.meta["entry_point"])
    return out


def pass_at_1(problems: dict[str, Problem], outputs: Sequence[tuple[str, Sequence[int]]],
              decode: Callable[[Sequence[int]], str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float | None:
    """Share of (prompt id, generated token ids) whose decoded, truncated completion passes its
    problem's test (one sample per problem: pass@1); None if there are no outputs."""
    if not outputs:
        return None
    passed = sum(run_problem(problems[pid], truncate_completion(decode(ids)), timeout_s) == "passed"
                 for pid, ids in outputs)
    return passed / len(outputs)


def summary_fields(exp: Any, recorder: Any, baseline: Any, decode: Callable[[Sequence[int]], str]) -> dict:
    """``pass_at_1`` (and ``pass_at_1_baseline`` for the `ar` baseline when there is one) of a
    run's recorded outputs, for its summary."""
    from testbed.workloads import choose_prompts

    problems = problems_by_id(choose_prompts(exp))
    out: dict[str, Any] = {}
    for name, rec in (("pass_at_1", recorder), ("pass_at_1_baseline", baseline)):
        if rec is not None:
            out[name] = pass_at_1(problems, [(r["prompt_id"], r["output_ids"]) for r in rec.requests],
                                  decode)
    return out
