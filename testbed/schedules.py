"""Schedule names, and which backend runs which — the one table both backends, their schedule
registries and the config validation read.

A *schedule* is what ``schedule=`` names: one ``conf/schedule/NAME.yaml``. Its *implementation*
is the name, or ``sync_tree`` for ``sync`` with ``schedule.tree=true``; a backend runs an
implementation when it has the file ``BACKEND/schedules/FILE.py`` (FILE = the implementation's
name, ``async_tree`` for ``async``, a Python keyword), which registers it in that backend's
``ScheduleRegistry``. So adding a schedule is one file per backend that runs it plus one conf
file; nothing here changes. (Files are looked up, never imported: testbed imports no backend.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from testbed.paths import ROOT

BACKENDS = ("sim", "real")  # values of backend=
TREE_VARIANT = {"sync": "sync_tree"}  # schedule.tree=true selects this implementation
MODULE_FILE = {"async": "async_tree"}  # implementation -> file stem, where they differ


def schedule_names() -> tuple[str, ...]:
    """The values of ``schedule=``: one per conf/schedule/*.yaml."""
    return tuple(sorted(p.stem for p in (ROOT / "conf" / "schedule").glob("*.yaml")))


SCHEDULES = schedule_names()


def implementation(name: str, tree: bool) -> str:
    """The implementation a schedule name and its tree flag select (``sync`` + tree -> sync_tree)."""
    return TREE_VARIANT.get(name, name) if tree else name


def schedule_impl(exp: Any) -> str:
    """The implementation an experiment runs (its summary's ``schedule``)."""
    return implementation(exp.schedule.name, exp.schedule.tree)


def all_implementations() -> tuple[str, ...]:
    return tuple(n for name in SCHEDULES for n in (name, TREE_VARIANT.get(name)) if n)


def module_file(impl: str) -> str:
    return MODULE_FILE.get(impl, impl)


def runs_on(backend: str, impl: str) -> bool:
    return impl in all_implementations() and \
        (ROOT / backend / "schedules" / f"{module_file(impl)}.py").is_file()


def implementations(backend: str) -> tuple[str, ...]:
    """The implementations a backend runs, in SCHEDULES order."""
    return tuple(impl for impl in all_implementations() if runs_on(backend, impl))


def describe(impl: str) -> str:
    """How a user selects an implementation: ``sync_tree`` -> ``sync (tree)``."""
    base = next((name for name, variant in TREE_VARIANT.items() if variant == impl), None)
    return f"{base} (tree)" if base else impl


def unsupported(backend: str, name: str, tree: bool) -> str | None:
    """Why ``schedule=name`` (with ``schedule.tree``) cannot run on ``backend``, else None.
    A tree flag that selects no tree implementation is refused off the simulator (a real run
    would silently decode without a tree)."""
    impl = implementation(name, tree)
    ignored_tree = tree and name not in TREE_VARIANT and backend != "sim"
    if runs_on(backend, impl) and not ignored_tree:
        return None
    mine = implementations(backend)
    allowed = [describe(i) + (" (without tree)" if i in TREE_VARIANT and TREE_VARIANT[i] not in mine
                              else "") for i in mine]
    others = [describe(i) for i in all_implementations() if i not in mine]
    return f"{' or '.join(allowed)} with backend={backend}; {', '.join(others)} run on backend=sim"


S = TypeVar("S", bound=Callable[..., Any])


class ScheduleRegistry(Generic[S]):
    """A backend's schedules by implementation name: each ``BACKEND/schedules/FILE.py``
    decorates its entry point with ``@REGISTRY.register(impl)``; ``get`` imports the file on
    first use (the package name is a string: this module imports no backend)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.schedules: dict[str, S] = {}

    def register(self, impl: str) -> Callable[[S], S]:
        def deco(fn: S) -> S:
            self.schedules[impl] = fn
            return fn
        return deco

    def get(self, impl: str) -> S:
        if impl not in self.schedules:
            if not runs_on(self.backend, impl):
                raise KeyError(f"schedule {impl!r} does not run on backend={self.backend}: "
                               f"allowed {', '.join(implementations(self.backend))}")
            importlib.import_module(f"{self.backend}.schedules.{module_file(impl)}")
        return self.schedules[impl]
