"""A two-stage pipeline in this process: stage 0 on the caller's thread, stage 1 on a thread of
its own, joined by LoopbackTransports (optionally with an emulated one-way latency)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from real.model.decoder import Transformer
from real.runtime.links import Message
from real.runtime.loopback import LoopbackTransport
from real.runtime.pipeline import Stage, Verify, stage_worker, stop
from testbed.links import LinkModel
from testbed.placement import LinkSpec
from testbed.recorder import RunRecorder

T = TypeVar("T")


def _link(src: str, dst: str, latency_s: float) -> dict[tuple[int, int], LinkSpec]:
    if not latency_s:
        return {}
    name = f"link {src}->{dst}"
    key = (0, 1) if src == "stage0" else (1, 0)
    return {key: LinkSpec(name, src, dst, LinkModel(name, latency_s), True)}


def run_ring(first: Transformer, last: Transformer, *, split: int, make_verify: Callable[[Message], Verify],
             serve: Callable[[Stage], T], rec: RunRecorder, latency_s: float = 0.0, features: bool = False,
             sent: list[Message] | None = None) -> T:
    """``serve(stage0)`` while stage 1 (``last``'s layers from ``split`` on; ``features``: it
    returns the target's features, as for an eagle draft) serves windows; then STOP, the thread
    joined, every transport closed; a stage-1 error fails the caller. ``sent``: collects every
    message stage 1 sends back."""
    fwd = LoopbackTransport.connect("stage:stage0->stage1", (0, 1), links=_link("stage0", "stage1", latency_s),
                                    recv_timeout_s=30.0)
    back = LoopbackTransport.connect("stage:stage1->stage0", (0, 1), links=_link("stage1", "stage0", latency_s),
                                     recv_timeout_s=30.0)
    if sent is not None:
        send = back[1].send

        def record(msg: Message, dst: int | None = None) -> None:
            sent.append(msg)
            send(msg, dst)

        back[1].send = record  # type: ignore[method-assign]
    s0 = Stage(first, (0, split), 0, 2, back[0], fwd[0], rec, time.perf_counter)
    s1 = Stage(last, (split, last.args.n_layers), 1, 2, fwd[1], back[1], RunRecorder(keep_spans=False),
               time.perf_counter, features=features)
    errors: list[BaseException] = []

    def last_stage() -> None:
        try:
            with torch.inference_mode():  # as a stage process runs (inference mode is per thread)
                stage_worker(s1, make_verify)
        except BaseException as e:  # noqa: BLE001 — reported to the caller
            errors.append(e)

    thread = threading.Thread(target=last_stage)
    thread.start()
    try:
        out = serve(s0)
        stop(s0)
    finally:
        thread.join(60)
        for end in (*fwd.values(), *back.values()):
            end.close()
    assert not errors, errors
    return out
