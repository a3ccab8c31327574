"""Real schedules, keyed by implementation name like sim/schedules (testbed.schedules: the
module of each is named by its declaration, ``ScheduleSpec.modules["real"]``, and imported on
first use; a declaration that names a module here is what lets backend=real run it).

An entry serves one request on the wall clock, recording rounds, spans and the request exactly
as the simulator's schedule of the same name does. What it is follows the schedule's layout, whose
runner calls it (real/runtime/layouts.py):

- ``single`` and ``tree``: a function ``(ctx: RealContext, req: RealRequest) -> None`` from
  prefill to the last token (every rank of an SPMD group runs it on its shard);
- ``two_groups``: a ``TwoGroups`` — each group's half and its probes (real/runtime/async_run.py);
- ``pipeline``: the first stage's *flow* for one request, a generator that yields whenever it
  waits for the last stage's answer (real/runtime/pipeline.py; served alone or several in flight
  by real/runtime/pipeline_run.py; the other stages only forward activations). `ar` over a
  pipeline is the runner's own flow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from real.runtime.context import RealContext, RealRequest
from testbed.registry import Registry
from testbed.schedules import implementation_registry


@dataclass(frozen=True)
class TwoGroups:
    """A ``two_groups`` schedule: what each group's ranks run per request, and the probes each
    group times before the first (real/runtime/async_run.py passes every function its group's side)."""

    target: Callable[..., list[int]]  # (side, req, eos) -> the request's output ids
    draft: Callable[..., None]  # (side, req, depth, *, width, budget)
    probe_target: Callable[..., None]  # (side, exp, first request)
    probe_draft: Callable[..., Any]  # (side, exp, first request) -> (depth, t_target, t_draft)
    before_request: Callable[..., None]  # (side, role, req)


OneProcess = Callable[[RealContext, RealRequest], None]  # the single and tree layouts' entries
Schedule = Any  # a OneProcess, a TwoGroups or a pipeline's first-stage flow
REGISTRY: Registry[Schedule] = implementation_registry("real")
register = REGISTRY.register
get_schedule = REGISTRY.get
