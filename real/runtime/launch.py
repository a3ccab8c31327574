"""Start the workers of a multi-process real run, watch them, gather their records.

The mirror of ``sim/runtime/topology.py``: the placement (``testbed.placement``: groups of ranks, their
channels and links) becomes processes — one worker per device — joined in one
``torch.distributed`` job (``init_process_group("cpu:gloo,cuda:nccl")``, gloo alone on a build
without NCCL) with one process group per channel.

API (what schedules are written against)::

    from real.runtime.launch import launch, merge_records
    from real.runtime.worker import WorkerContext
    from real.runtime.links import Kind, Message

    def ping(ctx: WorkerContext, rounds: int) -> int:     # module level: workers import it
        if ctx.role == "draft":                            # async: draft group -> target group
            out = ctx.transport_to("target")
            for r in range(rounds):
                out.send(Message(Kind.DRAFT, request_id=0, round=r,
                                 tensors=(torch.arange(4, dtype=torch.int32),)))
            return rounds
        inbox = ctx.transport_from("draft")
        got = [inbox.recv() for _ in range(rounds)]       # LinkTimeout after real.recv_timeout_s
        ctx.rec.round(...)                                 # records as in the simulator
        return len(got)

    results = launch(exp, ping, args=(8,))                 # list[WorkerResult], by rank
    rec = merge_records(results)                           # one RunRecorder for write_run

``launch(exp, fn, *, args=(), placement=None, timeout_s=None) -> list[WorkerResult]``

- one device (``placement.world_size == 1``): ``fn`` runs in this process, no torch.distributed;
- otherwise, not under torchrun: spawns one worker per rank (torch.multiprocessing, ``spawn``),
  rendezvous through a ``FileStore`` in a fresh temporary directory (parallel runs never collide,
  no port is used); each worker pins itself to its core with one intra-op thread (CPU) or takes
  its local GPU (``real.device=cuda``), creates every channel's process group, runs
  ``fn(ctx, *args)``, flushes its transports, meets the others at a barrier and sends back a
  ``WorkerResult`` (rank, role, group, ``fn``'s picklable value, its ``RunRecorder``);
- under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this process is one rank; results
  are gathered on rank 0 (the only process that writes the run directory, ``is_writer()``);
  other ranks get ``[]``.

``WorkerContext`` (real/runtime/worker.py): ``rank``, ``role``, ``info`` (group, layers, TP index),
``group``, ``is_leader``, ``placement``, ``device``, ``exp``, ``rec`` (a RunRecorder whose times
are ``ctx.now()``: seconds since the run's origin on the clock all workers share),
``tp_group()`` (the process group of this rank's TP all-reduce, None at TP 1),
``transport_to(group)`` / ``transport_from(group)`` (leaders: the ``real.runtime.links.Transport`` of
the link to / from another group), ``groups`` / ``transports`` by channel name, and
``broadcast_decision(obj)`` (the leader's object on every rank of its group).

Faults. The launcher watches every worker (process sentinels plus one result pipe each). A
worker that dies, raises, or times out in a receive ends the run: after a short grace period
(to tell the cause from its consequences: a dead peer makes the others' receives fail) every
worker is ended and ``real.errors.WorkerFailed`` is raised with one line naming the rank, its
role and the cause (the CLI prints it and exits with code 3). Workers die with the launcher
(``PR_SET_PDEATHSIG``); Ctrl-C in the launcher ends every worker, then re-raises. Workers never
write the run directory, so nothing is half-written. A worker that finishes waits for the others
at most ``real.recv_timeout_s`` (a rank that never finishes is named).

Spawned workers re-import the launching program's main module, so a script that calls
``launch`` must guard its entry with ``if __name__ == "__main__":`` (``python -m testbed``
does), and ``fn`` must be importable (module level). A worker prints its traceback to stderr
when ``SPECBED_WORKER_TRACEBACK=1``; otherwise the one line is all that is shown.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from real.errors import WorkerFailed
from real.runtime.worker import (
    STARTUP_TIMEOUT_S,
    WorkerContext,
    WorkerResult,
    backend_name,
    finish,
    place,
    setup,
    worker_main,
)
from testbed.config import ExperimentConfig
from testbed.placement import Placement, PlacementError, make_placement
from testbed.recorder import RunRecorder

GRACE_S = 1.0  # after the first failure, wait this long for its root cause to show
# which failure explains the others: a dead process first, then an exception, then time-outs
PRIORITY = {"died": 0, "raised": 1, "timeout": 2, "link": 3}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def is_writer() -> bool:
    """Whether this process writes the run directory (the launcher; torchrun: rank 0)."""
    return not under_torchrun() or os.environ["RANK"] == "0"


def launch(exp: ExperimentConfig, fn: Callable[..., Any], *, args: tuple = (),
           placement: Placement | None = None, timeout_s: float | None = None) -> list[WorkerResult]:
    """Run ``fn(ctx, *args)`` on every rank of the placement; see the module docstring."""
    if under_torchrun():
        return _launch_torchrun(exp, fn, args, placement)
    pl = placement or make_placement(exp)
    if pl.world_size == 1:
        ctx = WorkerContext(exp, pl, 0, torch.device(exp.real.device), RunRecorder(),
                            time.perf_counter(), exp.real.recv_timeout_s)
        info = pl.rank(0)
        return [WorkerResult(0, info.role, info.group, fn(ctx, *args), ctx.rec)]
    return _launch_spawn(exp, fn, args=args, pl=pl, timeout_s=timeout_s)


def run_placement(exp: ExperimentConfig) -> Placement:
    """The placement of a run as this process starts it: made once, where the run starts, and
    handed to the runner, the launch and every worker (in its spawn arguments). Under torchrun
    its devices are torchrun's processes per machine and its hosts the machines."""
    if not under_torchrun():
        return make_placement(exp)
    world = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return make_placement(exp, devices=local_world, hosts=max(1, world // local_world))


def merge_records(results: list[WorkerResult]) -> RunRecorder:
    """The records of all workers as one run: rounds and requests as recorded (usually by the
    leaders), requests by id, spans by start time."""
    rec = RunRecorder()
    for r in sorted(results, key=lambda w: w.rank):
        rec.rounds += r.rec.rounds
        rec.requests += r.rec.requests
        rec.spans += r.rec.spans
    rec.rounds.sort(key=lambda t: (t[0], t[1]))
    rec.requests.sort(key=lambda d: d["request_id"])
    rec.spans.sort(key=lambda t: t[2])
    return rec


# --------------------------------------------------------------------------------- spawn
def _launch_spawn(exp: ExperimentConfig, fn: Callable[..., Any], *, args: tuple, pl: Placement,
                  timeout_s: float | None) -> list[WorkerResult]:
    cpus = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    rdzv = tempfile.mkdtemp(prefix="specbed-rdzv-")
    procs: list[Any] = []
    pipes: dict[Connection, int] = {}
    try:
        for rank in range(pl.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"specbed-{pl.rank(rank).describe()}",
                            args=(rank, exp, pl),
                            kwargs={"fn": fn, "args": args, "store_path": os.path.join(rdzv, "store"),
                                    "cpus": cpus, "conn": writer},
                            daemon=True)
            p.start()
            writer.close()
            procs.append(p)
            pipes[reader] = rank
        return _watch(pl, procs, pipes, timeout_s)
    finally:
        _end_all(procs)
        for c in pipes:
            c.close()
        shutil.rmtree(rdzv, ignore_errors=True)


def _watch(pl: Placement, procs: list[Any], pipes: dict[Connection, int],
           timeout_s: float | None) -> list[WorkerResult]:
    """Wait for every result; on the first failure, find its root cause and raise."""
    results: dict[int, WorkerResult] = {}
    failures: list[tuple[int, float, str]] = []  # (priority, time, line)
    open_pipes = dict(pipes)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first_failure: float | None = None
    while len(results) < len(procs):
        now = time.monotonic()
        if first_failure is not None and now - first_failure >= GRACE_S:
            break
        if deadline is not None and now >= deadline:
            failures.append((PRIORITY["timeout"], now, f"the run exceeded its limit of {timeout_s:g} s"))
            break
        waits = [d for d in (deadline, first_failure and first_failure + GRACE_S) if d is not None]
        ready = wait(list(open_pipes) + list(sentinels),
                     timeout=min([0.5] + [max(0.0, d - now) for d in waits]))
        for obj in ready:
            if obj in open_pipes:
                rank = open_pipes.pop(obj)
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    continue  # closed without a report: the sentinel tells how it ended
                except Exception as e:  # noqa: BLE001 — e.g. a value that cannot be unpickled here
                    msg = ("error", "raised", f"{pl.rank(rank).describe()} returned a result the "
                           f"launcher cannot read: {type(e).__name__}: {e}")
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    failures.append((PRIORITY[msg[1]], time.monotonic(), msg[2]))
            elif obj in sentinels:
                rank = sentinels[obj]
                procs[rank].join(1.0)  # it has exited: this only reaps it
                code = procs[rank].exitcode
                # a report may still sit in the pipe of a process that just exited
                pipe = next((c for c, r in open_pipes.items() if r == rank), None)
                if pipe is not None and pipe.poll(0):
                    continue  # read it on the next turn; keep watching the sentinel until then
                del sentinels[obj]
                if rank not in results and code != 0 and not _reported(rank, failures, pl):
                    failures.append((PRIORITY["died"], time.monotonic(),
                                     f"{pl.rank(rank).describe()} died: {_exit_cause(code)}"))
                elif rank not in results and code == 0:
                    failures.append((PRIORITY["died"], time.monotonic(),
                                     f"{pl.rank(rank).describe()} exited without a result"))
        if failures and first_failure is None:
            first_failure = time.monotonic()
    if failures:
        _end_all(procs)
        raise WorkerFailed(min(failures)[2])
    return [results[r] for r in sorted(results)]


def _reported(rank: int, failures: list[tuple[int, float, str]], pl: Placement) -> bool:
    who = pl.rank(rank).describe()
    return any(line.startswith(who + " ") for _, _, line in failures)


def _exit_cause(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _end_all(procs: list[Any]) -> None:
    """SIGTERM every live worker, then SIGKILL what is left; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    t_end = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, t_end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


# ------------------------------------------------------------------------------ torchrun
def _launch_torchrun(exp: ExperimentConfig, fn: Callable[..., Any], args: tuple,
                     placement: Placement | None) -> list[WorkerResult]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hosts = max(1, world // local_world)
    pl = placement or make_placement(exp, devices=local_world, hosts=hosts)
    if pl.world_size != world:
        raise PlacementError("placement", f"the placement needs {pl.world_size} ranks but torchrun "
                             f"started {world}: run torchrun with --nnodes x --nproc-per-node = "
                             f"{pl.world_size}, or change placement.*")
    device = place(exp, local_rank, sorted(os.sched_getaffinity(0)))
    dist.init_process_group(backend_name(exp, pl), rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, exp.real.recv_timeout_s)))
    try:
        ctx = setup(exp, pl, rank=rank, device=device, hosts=hosts)
        value = fn(ctx, *args)
        finish(ctx)
        info = pl.rank(rank)
        mine = WorkerResult(rank, info.role, info.group, value, ctx.rec)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return [g for g in gathered if g is not None] if gathered is not None else []
    finally:
        dist.destroy_process_group()
