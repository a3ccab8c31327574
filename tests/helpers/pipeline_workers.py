"""Worker functions for the pipeline fault tests (module level: spawned workers import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from real.runtime.pipeline import Stage
from real.runtime.pipeline_run import pipeline_rank
from real.runtime.worker import WorkerContext


def pipeline_rank_killed(ctx: WorkerContext, group: str, stamp: str) -> Any:
    """``pipeline_rank``, but the stage ``group``'s process SIGKILLs itself when it starts
    computing request 1 (mid-run: models loaded, the ring in use), after writing the time to
    ``stamp``."""
    if ctx.group.name == group:
        timed = Stage.timed

        def dying(self, x, start, **kw):  # type: ignore[no-untyped-def]
            if kw["request_id"] == 1:
                Path(stamp).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return timed(self, x, start, **kw)

        Stage.timed = dying  # type: ignore[method-assign]
    return pipeline_rank(ctx)
