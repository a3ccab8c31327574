"""One real job at a time on this host, shared by the ranks of one job.

Two `backend=real` runs on one machine distort each other's timings, so each job holds the host
lock while it runs. A job is one process (``python -m testbed``: it spawns its own workers after
taking the lock) or every rank of one torchrun job: those ranks are separate processes that each
run the app, so an exclusive per-process lock would make them wait on each other until torchrun's
rendezvous times out. The lock is therefore keyed: ``job_key()`` is the same for every rank of a
torchrun job (its run id and master address) and unique for any other process; a process enters
when the lock is free or already held under its own key.

State: ``specbed-real-jobs.json`` in the temporary directory ({"key": ..., "holders": [[pid,
start time], ...]}), read and written under a short-held file lock; a holder whose process has
ended (a crash, a kill) is dropped on the next read, so the lock never outlives its job.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from filelock import FileLock

REAL_LOCK = Path(tempfile.gettempdir()) / "specbed-real-jobs.lock"  # guards STATE (held briefly)
STATE = REAL_LOCK.with_suffix(".json")
POLL_S = 0.2
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def job_key(env: dict[str, str] | None = None, pid: int | None = None) -> str:
    """The same string for every rank of one torchrun job (on any host), unique otherwise."""
    env = dict(os.environ) if env is None else env
    if all(k in env for k in TORCHRUN_ENV):
        return (f"torchrun {env.get('TORCHELASTIC_RUN_ID', '')} "
                f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}")
    return f"process {os.getpid() if pid is None else pid}"


def _me() -> list[float]:
    p = psutil.Process()
    return [p.pid, p.create_time()]


def _alive(holder: list[float]) -> bool:
    try:
        return psutil.Process(int(holder[0])).create_time() == holder[1]
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError, IndexError, TypeError):
        return False


def _update(change: Callable[[dict], Any]) -> Any:
    """Read the state (dropping ended holders), apply ``change`` and write it back, atomically."""
    with FileLock(str(REAL_LOCK), timeout=60):
        try:
            state = json.loads(STATE.read_text())
        except (OSError, ValueError):
            state = {}
        state["holders"] = [h for h in state.get("holders", []) if _alive(h)]
        if not state["holders"]:
            state = {"key": None, "holders": []}
        ok = change(state)
        tmp = STATE.with_suffix(".tmp")
        tmp.write_text(json.dumps(state) + "\n")
        tmp.replace(STATE)
        return ok


def try_enter(key: str, me: list[float] | None = None) -> bool:
    """Hold the host lock under ``key`` if it is free or held under the same key."""
    holder = me or _me()

    def enter(state: dict) -> bool:
        if state["holders"] and state["key"] != key:
            return False
        state["key"] = key
        state["holders"].append(holder)
        return True

    return bool(_update(enter))


def leave(me: list[float] | None = None) -> None:
    holder = me or _me()

    def drop(state: dict) -> bool:
        state["holders"] = [h for h in state["holders"] if h != holder]
        if not state["holders"]:
            state["key"] = None
        return True

    _update(drop)


def holder_key() -> str | None:
    """The key the lock is held under now (None: free)."""
    return _update(lambda state: state["key"])


@contextlib.contextmanager
def held(name: str, key: str | None = None) -> Iterator[None]:
    """Wait until this job may run on the host (printing once that it waits), hold it, release."""
    key = key or job_key()
    me = _me()
    if not try_enter(key, me):
        print(f"{name}: waiting for another real run on this host to finish "
              f"(real.allow_concurrent=true runs them at once)", file=sys.stderr, flush=True)
        while not try_enter(key, me):
            time.sleep(POLL_S)
    try:
        yield
    finally:
        leave(me)
