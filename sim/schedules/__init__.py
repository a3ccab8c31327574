"""Schedules as SimPy processes, keyed by implementation name (testbed.schedules: `schedule=`,
and `sync_tree` for `schedule.tree=true`); the module of each is named by its declaration
(``ScheduleSpec.modules["sim"]``: a file here for the built-in ones) and imported on first use.

A schedule is a generator function ``(ctx: SimContext, req: SimRequest)`` that serves one
request from prefill to its last token, yielding SimPy events (one timeout per forward or per
message) and recording rounds, spans and the request through ``ctx.rec``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from sim.runtime.context import SimContext, SimRequest
from testbed.registry import Registry
from testbed.schedules import implementation_registry

Schedule = Callable[[SimContext, SimRequest], Generator[Any, Any, None]]
REGISTRY: Registry[Schedule] = implementation_registry("sim")
register = REGISTRY.register
get_schedule = REGISTRY.get
