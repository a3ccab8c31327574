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
  (real/calibrate/probe_forward.py; sim.profile_drift=forward corrects the profile by it);
- ``preload()``: import what its runs import on first use (a joblib sweep worker warms up while
  the pre-run check runs: testbed.app.worker_pool).

A hook that only one backend provides is found with ``hook(name)``. ``options``: the values a
setting may take that only the backend knows, each a ``Registry`` (the simulator's
``sim.cost_model`` and ``acceptance`` oracles): ``option_names(key)`` lists them for the
validation and ``--help``.

``BACKENDS`` is a ``Registry`` (testbed.registry): ``sim`` and ``real`` are declared here by the
module that registers them, so their names are known without importing either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.registry import Registry


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
    options: Mapping[str, Registry[Any]] = field(default_factory=dict)


BACKENDS: Registry[Backend] = Registry("backend")
for _name in ("sim", "real"):  # the values of backend=; each NAME/backend.py registers itself
    BACKENDS.declare(_name, f"{_name}.backend")


def register(backend: Backend) -> Backend:
    return BACKENDS.register(backend.name, backend)


def get(name: str) -> Backend:
    """The backend called ``name``, importing its ``NAME.backend`` module on first use."""
    return BACKENDS.get(name)


def names() -> tuple[str, ...]:
    return BACKENDS.names()


def registered() -> list[Backend]:
    """The backends imported so far (nothing is imported here)."""
    return BACKENDS.loaded()


def option_names(key: str) -> tuple[str, ...]:
    """The values of setting ``key`` (e.g. ``sim.cost_model``) from the backend that declares
    them; () when none does."""
    for backend in BACKENDS.names():
        reg = get(backend).options.get(key)
        if reg is not None:
            return reg.names()
    return ()


def user_error_types() -> tuple[type[Exception], ...]:
    """Actionable error types of the backends in use (one not imported raised nothing)."""
    return tuple(t for b in registered() for t in b.user_errors)


def hook(name: str) -> Callable[..., Any] | None:
    """The first backend's (in BACKENDS order) hook ``name``, or None if no backend has it."""
    for backend in BACKENDS.names():
        fn = getattr(get(backend), name)
        if fn is not None:
            return fn
    return None
