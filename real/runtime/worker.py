"""Inside one worker process of a multi-process run: its context and its life cycle.

``real/runtime/launch.py`` starts the workers (see its docstring for the API); this module is what runs
in each of them: pin to the device, join the torch.distributed job, create one process group per
channel (every rank, every group, same order), build the transports of its channels, run the
worker function, flush, meet the others at a final barrier and report.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from real.runtime.links import DistTransport, LinkError, LinkTimeout, Transport
from testbed.config import ExperimentConfig
from testbed.placement import BRIDGE, STAGE, Group, Placement, RankInfo
from testbed.recorder import RunRecorder

STARTUP_TIMEOUT_S = 120.0  # rendezvous: workers import torch at different speeds
TRACEBACK_ENV = "SPECBED_WORKER_TRACEBACK"  # set to print a failing worker's traceback


@dataclass
class WorkerResult:
    """What a worker sends back: its function's (picklable) value and its records."""

    rank: int
    role: str
    group: str
    value: Any
    rec: RunRecorder


@dataclass
class WorkerContext:
    """Everything a worker function needs (see real/runtime/launch.py for an example)."""

    exp: ExperimentConfig
    placement: Placement
    rank: int
    device: torch.device
    rec: RunRecorder
    t0: float  # time.perf_counter() of the run's origin on this host (clock offset applied)
    recv_timeout_s: float
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)  # channel name -> group
    transports: dict[str, Transport] = field(default_factory=dict)  # channel name -> this end
    run_id: str = ""  # the same on every rank of one launch (store keys)

    @property
    def info(self) -> RankInfo:
        return self.placement.rank(self.rank)

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def group(self) -> Group:
        return self.placement.group_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.group.leader == self.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def link_device(self) -> torch.device:
        """Where this rank's messages and collectives live: its GPU, or the host when ranks share
        a GPU (``shares_gpu``)."""
        return torch.device("cpu") if shares_gpu(self.exp, self.placement) else self.device

    def now(self) -> float:
        """Seconds since the run's origin, on the clock every worker shares."""
        return time.perf_counter() - self.t0

    def tp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's tensor-parallel all-reduce (None at TP 1)."""
        ch = self.placement.tp_channel(self.group.name)
        return None if ch is None else self.groups[ch.name]

    def transport_to(self, group: str) -> Transport:
        """The transport carrying this group's messages to ``group`` (leaders only)."""
        return self._transport(self.group.name, group)

    def transport_from(self, group: str) -> Transport:
        """The transport carrying ``group``'s messages to this group (leaders only)."""
        return self._transport(group, self.group.name)

    def _transport(self, src: str, dst: str) -> Transport:
        name = self.placement.link(src, dst).name
        for ch in self.placement.channels:
            if name in ch.links and ch.name in self.transports:
                return self.transports[ch.name]
        raise KeyError(f"{self.info.describe()} has no channel for {name} (only group leaders talk "
                       "across groups)")

    def broadcast_decision(self, obj: Any = None) -> Any:
        """The leader's ``obj`` on every rank of this group (call on all of them, before each
        forward, so no rank waits on a collective the others never enter)."""
        pg = self.tp_group()
        if pg is None:
            return obj
        box = [obj if self.is_leader else None]
        dev = self.link_device if self.link_device.type == "cuda" else None
        dist.broadcast_object_list(box, src=self.group.leader, group=pg, device=dev)
        return box[0]


# --------------------------------------------------------------------------- life cycle
def shares_gpu(exp: ExperimentConfig, pl: Placement) -> bool:
    """Several ranks on one GPU (a pipeline's stages sharing it): NCCL refuses two ranks on one
    device, so such a run talks over gloo with host tensors (its links are emulated anyway)."""
    if not exp.real.device.startswith("cuda"):
        return False
    return pl.world_size > max(1, torch.cuda.device_count())


def backend_name(exp: ExperimentConfig | None = None, pl: Placement | None = None) -> str:
    if exp is not None and pl is not None and shares_gpu(exp, pl):
        return "gloo"
    return "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when the launcher dies, so no worker is ever orphaned."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def place(exp: ExperimentConfig, local_rank: int, cpus: list[int]) -> torch.device:
    """Bind this process to its device: a GPU, or one core with one intra-op thread."""
    if exp.real.device.startswith("cuda"):
        index = local_rank % max(1, torch.cuda.device_count())  # stages may share one GPU
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})
    torch.set_num_threads(1)
    return torch.device("cpu")


def make_groups(pl: Placement, timeout_s: float) -> dict[str, dist.ProcessGroup]:
    """One process group per channel; every rank creates every group, in the same order."""
    out = {}
    for ch in pl.channels:
        g = dist.new_group(list(ch.ranks), timeout=timedelta(seconds=timeout_s))
        if dist.get_rank() in ch.ranks:
            out[ch.name] = g
    return out


def make_transports(ctx: WorkerContext) -> dict[str, Transport]:
    pl, out = ctx.placement, {}
    for ch in pl.channels:
        if ch.kind not in (BRIDGE, STAGE) or ctx.rank not in ch.ranks:
            continue
        links = {}
        for name in ch.links:
            spec = next(lk for lk in pl.links if lk.name == name)
            links[(pl.group(spec.src).leader, pl.group(spec.dst).leader)] = spec
        t = DistTransport(
            group=ctx.groups[ch.name], device=ctx.link_device, channel=ch.name, rank=ctx.rank,
            names={r: pl.rank(r).describe() for r in ch.ranks}, links=links, seed=ctx.exp.seed,
            clock=ctx.now, recv_timeout_s=ctx.recv_timeout_s, rec=ctx.rec)
        if any(spec.emulated for spec in links.values()):
            t.measure_lead()  # so the emulated delay is the total, transport included
        out[ch.name] = t
    return out


def run_origin(hosts: int) -> tuple[float, str]:
    """(the run's time origin in this process's perf_counter: rank 0's reading, a run id).
    On one host every process reads the same monotonic clock; across hosts each rank estimates
    its offset to rank 0 from readings taken right after barriers (median of five)."""
    box = [time.perf_counter(), uuid.uuid4().hex]
    dist.broadcast_object_list(box, src=0)
    if hosts <= 1:
        return box[0], box[1]
    offsets = []
    for _ in range(5):
        dist.barrier()
        mine = time.perf_counter()
        readings: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(readings, mine)
        offsets.append(mine - readings[0])
    offsets.sort()
    return box[0] + offsets[len(offsets) // 2], box[1]


def setup(exp: ExperimentConfig, pl: Placement, *, rank: int, device: torch.device,
          hosts: int) -> WorkerContext:
    """After init_process_group: groups, the shared clock, transports."""
    timeout = exp.real.recv_timeout_s
    groups = make_groups(pl, timeout)
    t0, run_id = run_origin(hosts)
    ctx = WorkerContext(exp, pl, rank, device, RunRecorder(), t0, timeout, groups, run_id=run_id)
    ctx.transports = make_transports(ctx)
    return ctx


def finish(ctx: WorkerContext) -> None:
    """Flush this worker's messages, then wait for the others (nobody leaves while a peer may
    still talk to it), at most the receive timeout; a rank that never gets here is named. The
    barrier is on the rendezvous store: a collective would wait the startup timeout instead."""
    for t in ctx.transports.values():
        t.close()
    store = dist.distributed_c10d._get_default_store()
    key = f"specbed/{ctx.run_id}/finished"
    store.set(f"{key}/{ctx.rank}", "1")
    if store.add(key, 1) == ctx.world_size:
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"], timedelta(seconds=ctx.recv_timeout_s))
    except RuntimeError:
        pl = ctx.placement
        missing = [pl.rank(r).describe() for r in range(ctx.world_size)
                   if not store.check([f"{key}/{r}"])]
        raise LinkTimeout(f"{ctx.info.describe()} waited {ctx.recv_timeout_s:g} s (real.recv_timeout_s) "
                          f"at the end of the run for {', '.join(missing) or 'the others'}") from None


def failure(rank: int, pl: Placement, e: BaseException) -> tuple[str, str]:
    """(priority class, one line) of a worker's exception, for the launcher's report."""
    who = pl.rank(rank).describe()
    first = (str(e).splitlines() or [""])[0][:300]
    if isinstance(e, LinkTimeout):
        return "timeout", f"{who} timed out: {first.removeprefix(who).strip()}"
    if isinstance(e, LinkError):
        return "link", f"{who} lost a peer: {first.removeprefix(who).strip()}"
    if "Connection closed by peer" in first or "Connection reset" in first:
        return "link", f"{who} lost a peer: {first}"
    if isinstance(e, RuntimeError) and "timed out" in first.lower():  # a collective (TP group)
        return "timeout", f"{who} timed out in a collective (real.recv_timeout_s): {first}"
    return "raised", f"{who} raised {type(e).__name__}: {first}"


def quiet_tqdm_lock() -> None:
    """tqdm's default lock is a multiprocessing semaphore (built with the first bar, disabled
    ones too), which a worker leaving through os._exit never unlinks: the run then ended with a
    "leaked semaphore objects" warning per worker. A worker's bars are its own: a thread lock."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker_main(rank: int, exp: ExperimentConfig, pl: Placement, *, fn: Callable[..., Any],
                args: tuple, store_path: str, cpus: list[int], conn: Any) -> None:
    """Entry of a spawned worker: report ("ok", result) or ("error", class, line) on ``conn``."""
    import pickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which ends us
    die_with_parent()
    quiet_tqdm_lock()
    code = 0
    try:
        device = place(exp, rank, cpus)
        store = dist.FileStore(store_path, pl.world_size)
        dist.init_process_group(backend_name(exp, pl), store=store, rank=rank, world_size=pl.world_size,
                                timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, exp.real.recv_timeout_s)))
        ctx = setup(exp, pl, rank=rank, device=device, hosts=1)
        value = fn(ctx, *args)
        finish(ctx)
        info = pl.rank(rank)
        conn.send_bytes(pickle.dumps(("ok", WorkerResult(rank, info.role, info.group, value, ctx.rec))))
    except BaseException as e:  # noqa: BLE001 — every failure must reach the launcher as one line
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        kind, line = failure(rank, pl, e)
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(pickle.dumps(("error", kind, line)))
        code = 1
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo threads must not hang the exit

