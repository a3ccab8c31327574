"""What only a backend can do, asked through a registry: testbed imports no module of `sim` or
`real` (not even lazily); each backend's ``BACKEND/backend.py`` registers a ``Backend`` when it
is imported, and ``get(name)`` imports that module by its name (a string) the first time.

Hooks (None where a backend has no such capability):

- ``run(exp) -> RunResult``: execute or simulate one experiment;
- ``calibrate(exp, run_dir)``: ``+calibrate``, measure this machine's latency profile (real);
- ``user_errors``: exception types whose message names the bad setting and its fix (the app
  prints them in one line, exit 2, no traceback);
- ``tokenizer() -> tokenizer``: the bundled tokenizer, for exact prompt lengths (real; raises
  when it cannot be loaded here);
- ``replay_seconds(exp, run_dir) -> {request_id: decode seconds}``: the cost model's time for a
  recorded run's own rounds (sim's profile cost model; the validation report's timing-only
  error);
- ``probe_forward(exp) -> {model name: seconds}``: the pair's probe forward timed now
  (real/probe_forward.py; sim.profile_drift=forward corrects the profile by it);
- ``preload()``: import what its runs import on first use (a joblib sweep worker warms up while
  the pre-run check runs: testbed.worker_pool).

A hook that only one backend provides is found with ``hook(name)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.schedules import BACKENDS


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[Any], Any]
    calibrate: Callable[[Any, Path], Any] | None = None
    user_errors: tuple[type[Exception], ...] = ()
    tokenizer: Callable[[], Any] | None = None
    replay_seconds: Callable[[Any, Path], dict[int, float]] | None = None
    preload: Callable[[], None] | None = None
    probe_forward: Callable[[Any], dict[str, float]] | None = None


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    """The backend called ``name``, importing its ``NAME.backend`` module on first use."""
    if name not in _REGISTRY:
        if name not in BACKENDS:
            raise KeyError(f"backend {name!r}: allowed {', '.join(BACKENDS)}")
        importlib.import_module(f"{name}.backend")
    return _REGISTRY[name]


def registered() -> list[Backend]:
    """The backends imported so far (nothing is imported here)."""
    return list(_REGISTRY.values())


def user_error_types() -> tuple[type[Exception], ...]:
    """Actionable error types of the backends in use (one not imported raised nothing)."""
    return tuple(t for b in registered() for t in b.user_errors)


def hook(name: str) -> Callable[..., Any] | None:
    """The first backend's (in BACKENDS order) hook ``name``, or None if no backend has it."""
    for backend in BACKENDS:
        fn = getattr(get(backend), name)
        if fn is not None:
            return fn
    return None
