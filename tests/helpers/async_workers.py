"""Worker functions for the async fault tests (module level: spawned workers import them)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from real.runtime.async_run import async_rank
from real.runtime.worker import WorkerContext
from real.schedules import REGISTRY


def async_rank_killed(ctx: WorkerContext, role: str, stamp: str) -> Any:
    """``async_rank``, but the ``role`` group's worker SIGKILLs itself when its second request
    starts (mid-run: models loaded, the bridge in use), after writing the time to ``stamp``."""
    if ctx.role == role:  # the group's half of the registered schedule (real/schedules)
        halves = REGISTRY.get("async")
        serve = getattr(halves, role)

        def dying(side, req, *args, **kw):  # type: ignore[no-untyped-def]
            if req.request_id == 1:
                Path(stamp).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return serve(side, req, *args, **kw)

        REGISTRY.register("async", dataclasses.replace(halves, **{role: dying}))
    return async_rank(ctx)
