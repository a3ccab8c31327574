"""Worker functions for the multi-process runtime tests (module level: spawned workers import
them). No model: the runtime, the transports and the fault handling are what is tested."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from real.runtime.links import Kind, Message
from real.runtime.worker import WorkerContext


def ping_pong(ctx: WorkerContext, rounds: int) -> dict:
    """async placement: draft sends a window, target answers with the verified tokens; both
    groups broadcast a decision and all-reduce inside their TP group."""
    decision = ctx.broadcast_decision({"round0": ctx.rank} if ctx.is_leader else None)
    pg = ctx.tp_group()
    total = torch.tensor([float(ctx.rank)])
    if pg is not None:
        dist.all_reduce(total, group=pg)
    got = []
    if ctx.placement.layout != "two_groups":
        pass
    elif ctx.is_leader and ctx.role == "draft":
        out, back = ctx.transport_to("target"), ctx.transport_from("target")
        for r in range(rounds):
            big = torch.arange(20_000, dtype=torch.float32)  # beyond one frame: sent after it
            out.send(Message(Kind.DRAFT, request_id=0, round=r,
                             tensors=(torch.arange(r, r + 4, dtype=torch.int32),) + ((big,) if r == 1 else ())))
            got.append(back.recv().tensors[0].tolist())
    elif ctx.is_leader:
        inbox, out = ctx.transport_from("draft"), ctx.transport_to("draft")
        for r in range(rounds):
            m = inbox.recv()
            s = ctx.now()
            ctx.rec.round(request_id=0, round_idx=m.round, start_s=s, end_s=ctx.now(), drafted=4,
                          checked=1, accepted=1, emitted=2, verified_tokens=5)
            got.append(m.tensors[0].tolist() + [t.sum().item() for t in m.tensors[1:]])
            out.send(Message(Kind.VERIFIED, request_id=0, round=r, tensors=(m.tensors[0][:2] * 10,)))
    return {"rank": ctx.rank, "pid": os.getpid(), "decision": decision, "sum": total.item(),
            "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)), "got": got}


def stream(ctx: WorkerContext, n: int, nbytes: int) -> list[float]:
    """pipeline placement: stage0 sends n messages of nbytes to stage1, one at a time; stage1
    returns the one-way delays (receive time - send time on the shared clock)."""
    if ctx.info.group == "stage0":
        out, back = ctx.transport_to("stage1"), ctx.transport_from("stage1")
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for r in range(n):
            out.send(Message(Kind.ACTIVATIONS, round=r, tensors=(payload,)))
            back.recv()  # wait for the ack, so messages never queue behind each other
        return []
    inbox, ack = ctx.transport_from("stage0"), ctx.transport_to("stage0")
    delays = []
    for r in range(n):
        m = inbox.recv()
        delays.append(ctx.now() - m.sent_s)
        ack.send(Message(Kind.DATA, round=r))
    return delays


def fail(ctx: WorkerContext, how: str, stamp: str = "") -> None:
    """The draft's leader fails after one good exchange (writing the wall time of the fault to
    ``stamp`` if given); the target waits for a second message."""
    if ctx.role == "draft":
        out = ctx.transport_to("target")
        out.send(Message(Kind.DRAFT, round=0))
        out.flush()
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(7)
        if how == "raise":
            raise ValueError("boom in the draft")
        if how == "hang":
            time.sleep(3600)
    inbox = ctx.transport_from("draft")
    inbox.recv()
    inbox.recv()  # never comes


def sleep_forever(ctx: WorkerContext) -> None:
    time.sleep(3600)


def target_never_finishes(ctx: WorkerContext) -> None:
    if ctx.role == "target":
        time.sleep(3600)


def progress_bar(ctx: WorkerContext) -> int:
    """Draws a (disabled) tqdm bar, as real schedules do on every rank."""
    from tqdm import tqdm

    with tqdm(total=1, disable=True) as bar:
        bar.update(1)
    return ctx.rank
