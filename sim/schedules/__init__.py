"""Schedules as SimPy processes, keyed by implementation name (testbed.schedules: `schedule=`,
and `sync_tree` for `schedule.tree=true`); one file per implementation, imported on first use.

A schedule is a generator function ``(ctx: SimContext, req: SimRequest)`` that serves one
request from prefill to its last token, yielding SimPy events (one timeout per forward or per
message) and recording rounds, spans and the request through ``ctx.rec``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from sim.context import SimContext, SimRequest
from testbed.schedules import ScheduleRegistry

Schedule = Callable[[SimContext, SimRequest], Generator[Any, Any, None]]
REGISTRY: ScheduleRegistry[Schedule] = ScheduleRegistry("sim")
SCHEDULES = REGISTRY.schedules
register = REGISTRY.register
get_schedule = REGISTRY.get
