"""Serving under load over a pipeline of nodes (`decentralized`, and its `ar` baseline over the
same pipeline): several requests in flight at once, a stage working on one request's window
while a link carries another's.

The batched server (sim/runtime/batching.py) serves rounds of the whole batch; a pipeline's
stages instead pass each request's window along on their own, as DSD's nodes do. Each request
runs its one-request schedule (sim/schedules/decentralized.py, sim/runtime/pipeline.ar_pipeline)
as a SimPy process of its own; each stage is a resource of capacity one (``Pipeline.stages``),
taken in arrival order for each forward, and the first node's draft holds the first stage's
devices while it drafts. The links queue messages as they do for one request
(sim/runtime/links.py). Admission is the batched server's (testbed/admission.py, FCFS within
``serving.max_batch`` requests in flight and ``serving.kv_budget_tokens``), checked whenever a
request arrives or finishes.

With one request in flight every stage is free whenever asked, so the times are the
one-request-at-a-time schedule's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from sim.runtime.batching import send_requests
from sim.runtime.context import SimContext, SimRequest
from testbed.admission import Admission, mark_load


def serve_pipelined(ctx: SimContext, requests: list[SimRequest], schedule: Callable[..., Any], *,
                    arrivals: list[float] | None = None) -> Generator[Any, Any, None]:
    """Admit and run every request through ``schedule`` (a one-request schedule), several at
    once; ``arrivals`` as sim/runtime/batching.serve's."""
    env, rec = ctx.env, ctx.rec
    queue = Admission(ctx.exp)
    state = {"in_flight": 0, "finished": 0}
    all_done = env.event()
    unsent: deque[SimRequest] = deque()  # a closed loop's requests not sent yet

    def start_admitted() -> None:
        for req, t in queue.admit(state["in_flight"]):
            state["in_flight"] += 1
            env.process(one(req, t))

    def arrive(req: SimRequest) -> None:
        queue.arrive(req, env.now)
        start_admitted()

    def one(req: SimRequest, arrival: float) -> Generator[Any, Any, None]:
        admit, first_round = env.now, len(rec.rounds)
        yield env.process(schedule(ctx, req))
        mark_load(rec, req.request_id, arrival=arrival, admit=admit, finish=env.now, rounds_from=first_round)
        queue.release(req)
        state["in_flight"] -= 1
        state["finished"] += 1
        if arrivals is None and unsent:
            arrive(unsent.popleft())
        start_admitted()
        if state["finished"] == len(requests):
            all_done.succeed()

    unsent.extend(send_requests(ctx, requests, arrivals, arrive))
    if requests:
        yield all_done

