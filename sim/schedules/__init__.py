"""Schedules as SimPy processes, keyed by name (`schedule=` / `schedule.tree=true`).

A schedule is a generator function ``(ctx: SimContext, req: SimRequest)`` that serves one
request from prefill to its last token, yielding SimPy events (one timeout per forward or per
message) and recording rounds, spans and the request through ``ctx.rec``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator
from typing import Any

from sim.context import SimContext, SimRequest

Schedule = Callable[[SimContext, SimRequest], Generator[Any, Any, None]]
SCHEDULES: dict[str, Schedule] = {}
_MODULES = {"ar": "sim.schedules.ar", "sync": "sim.schedules.sync",
            "sync_tree": "sim.schedules.sync_tree", "async": "sim.schedules.async_tree",
            "decentralized": "sim.schedules.decentralized"}


def register(name: str) -> Callable[[Schedule], Schedule]:
    def deco(fn: Schedule) -> Schedule:
        SCHEDULES[name] = fn
        return fn
    return deco


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        if name not in _MODULES:
            raise KeyError(f"schedule {name!r}: allowed {', '.join(sorted(_MODULES))}")
        importlib.import_module(_MODULES[name])
    return SCHEDULES[name]
