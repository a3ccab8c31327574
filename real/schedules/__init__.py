"""Real schedules, keyed by implementation name like sim/schedules (testbed.schedules: one
file per implementation, imported on first use; a file here is what lets backend=real run it).

A schedule is a function ``(ctx: RealContext, req: RealRequest) -> None`` that serves one
request from prefill to its last token on the wall clock, recording rounds, spans and the
request through ``ctx.rec`` exactly as the simulator's schedule of the same name does.
"""

from __future__ import annotations

from collections.abc import Callable

from real.context import RealContext, RealRequest
from testbed.schedules import ScheduleRegistry

Schedule = Callable[[RealContext, RealRequest], None]
REGISTRY: ScheduleRegistry[Schedule] = ScheduleRegistry("real")
SCHEDULES = REGISTRY.schedules
register = REGISTRY.register
get_schedule = REGISTRY.get
