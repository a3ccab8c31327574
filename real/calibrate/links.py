"""Message cost between two processes on this host (real/calibrate/profile.py): a gloo ping-pong over
loopback per message size, whose one-way time the profile stores under ``links``."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

SCHEMA = 2  # 2: per-model "tp" tables, "allreduce", links.gloo_round_trip (real/calibrate/tp.py)



def round_trip_s(rank: int, size: int, repeats: int) -> float:
    """Median seconds of a ``size``-byte message from rank 0 to rank 1 and back (two warm-ups),
    in an initialised 2-rank gloo group; both ranks call it."""
    import torch.distributed as dist

    buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _pingpong(rank: int, port: int, *, sizes: list[int], repeats: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {size: round_trip_s(rank, size, repeats) / 2 for size in sizes}  # one way
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_messages(sizes: list[int], repeats: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """One-way message time between two processes over gloo/loopback and its α–β fit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_pingpong, args=(r, port), kwargs={"sizes": sizes, "repeats": repeats, "out": q},
                         daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return {"transport": "torch.distributed gloo, 127.0.0.1", **alpha_beta_fit(res)}


def alpha_beta_fit(seconds_by_size: dict[int, float]) -> dict[str, Any]:
    """``bytes``, ``seconds`` (by size) and their α–β fit: one-way time = α + bytes·β."""
    import numpy as np

    xs = np.array(sorted(seconds_by_size), dtype=float)
    ys = np.array([seconds_by_size[s] for s in sorted(seconds_by_size)])
    # relative weights: the small messages (latency-bound) matter as much as the large ones
    beta, alpha = np.polyfit(xs, ys, 1, w=1.0 / ys) if len(xs) > 1 else (0.0, float(ys[0]))
    return {"bytes": [int(x) for x in xs], "seconds": [float(y) for y in ys],
            "alpha_s": float(max(alpha, 0.0)), "beta_s_per_byte": float(max(beta, 0.0)),
            "bandwidth_gbps": float(1e-9 / beta) if beta > 0 else None}
