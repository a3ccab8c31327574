"""Schedules as declared objects: one ``ScheduleSpec`` per schedule, the table every part of the
testbed reads instead of comparing schedule names.

A *schedule* is what ``schedule=`` names (one ``conf/schedule/NAME.yaml``). An *implementation*
is what runs and what a run's summary calls ``schedule``: the schedule's name, or its tree
variant (``sync_tree`` is ``sync`` with ``schedule.tree=true``). Each implementation has one
``ScheduleSpec`` in ``SCHEDULES`` (a ``testbed.registry.Registry``), declaring:

- ``layout``: where its groups run (``testbed.placement``): ``single`` (one group, both models,
  tensor parallel), ``tree`` (one group on max(target, draft) devices), ``two_groups`` (disjoint
  draft and target groups joined by a bridge), ``pipeline`` (the target as stages over nodes);
- ``drafts``: whether it has a draft model (``ar`` has none: it is the baseline);
- ``reads``: the settings that take effect with it (``testbed.app.unused_settings`` reports the
  others), as key prefixes (``schedule.tree_*`` names every ``schedule.tree_…`` key);
- ``ar_baseline``: how its ``ar`` baseline is placed in the simulator (``target_devices``: the
  target on ``placement.target_gpus`` of one node; ``all_devices``: on every device its groups
  occupy; ``same_pipeline``: over the same pipeline of nodes and links); None for ``ar``;
- ``replays``: the implementations whose recorded rounds ``acceptance=trace`` replays for it,
  and ``trace_from``: the one ``howto`` tells a user to record;
- ``concurrent``: its groups run at the same time (the profile cost model's contention; a tree's
  depth chosen from both groups' forward times);
- ``tree``: it verifies token trees (``schedule.tree_*``, the tree's KV slots);
- ``batches``: it serves many requests at once under load (``workload.arrival``,
  ``workload.concurrency``, ``serving.*``: testbed/arrivals.py): in batched rounds, or, over a
  pipeline of nodes, several requests in flight through the stages;
- ``timeline``, ``color``, ``label``: the report's Gantt charts, colour and run label;
- ``modules``: the module implementing it per backend (``BACKEND/schedules/FILE.py`` for the
  built-in ones): a backend runs exactly the implementations that name it.

Derived from those: ``serial`` (draft and target one after the other on the same devices),
``chain`` (serial without a tree: Leviathan's Algorithm 1, where per-token lookahead policies
and Theorem 3.8 apply), ``pipelined`` (a drafting pipeline over links: DSD).

Adding a schedule: one file per backend (registering its entry with the backend's
``register``), one conf file, and its ``ScheduleSpec`` — a row below for a built-in schedule,
or, for one kept outside this repository, the ``__init__.py`` of a plug-in package named in the
``SPECBED_PLUGINS`` environment variable (comma separated; ``load_plugin`` does the same from
Python). A plug-in's ``conf_dir`` joins Hydra's search path (hydra_plugins/specbed_plugins), so
its ``schedule/NAME.yaml`` is found like a built-in one. Nothing here imports a backend: modules
are named by strings and imported by the backends' registries on first use.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from testbed.registry import Registry, UnknownName

# layouts (testbed.placement)
SINGLE, TREE, TWO_GROUPS, PIPELINE = "single", "tree", "two_groups", "pipeline"
LAYOUTS = (SINGLE, TREE, TWO_GROUPS, PIPELINE)
# placements of the `ar` baseline (sim/runtime/engine.py)
TARGET_DEVICES, ALL_DEVICES, SAME_PIPELINE = "target_devices", "all_devices", "same_pipeline"
PLUGINS_ENV = "SPECBED_PLUGINS"


@dataclass(frozen=True)
class ScheduleSpec:
    """One implementation's declaration (see the module docstring for the fields)."""

    name: str
    layout: str
    about: str = ""
    tree_of: str | None = None  # selected by schedule=<tree_of> schedule.tree=true
    drafts: bool = True
    tree: bool = False
    reads: frozenset[str] = frozenset()
    ar_baseline: str | None = TARGET_DEVICES
    replays: tuple[str, ...] = ()
    trace_from: str | None = None
    concurrent: bool = False
    batches: bool = False
    timeline: bool = False
    color: str = "#666666"
    label: str = "{schedule}"  # str.format fields: schedule, target_gpus, draft_gpus, nodes
    modules: Mapping[str, str] = field(default_factory=dict, compare=False)
    conf_dir: str | None = None  # a plug-in's conf directory (with schedule/NAME.yaml)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"ScheduleSpec {self.name!r}: layout={self.layout!r}, one of {', '.join(LAYOUTS)}")
        if self.ar_baseline not in (None, TARGET_DEVICES, ALL_DEVICES, SAME_PIPELINE):
            raise ValueError(f"ScheduleSpec {self.name!r}: ar_baseline={self.ar_baseline!r}")

    @property
    def schedule(self) -> str:
        """The ``schedule=`` value that selects it."""
        return self.tree_of or self.name

    @property
    def serial(self) -> bool:
        """Draft and target take turns on the same devices."""
        return self.drafts and self.layout in (SINGLE, TREE)

    @property
    def chain(self) -> bool:
        """A serial chain of γ guesses per round (Leviathan et al.'s Algorithm 1)."""
        return self.serial and not self.tree

    @property
    def pipelined(self) -> bool:
        """Draft windows verified by a pipeline of nodes over links (DSD)."""
        return self.drafts and self.layout == PIPELINE

    def runs_on(self, backend: str) -> bool:
        return backend in self.modules

    def run_label(self, **row: Any) -> str:
        """The report's label of one of its runs (e.g. ``t5`` for async with 5 target GPUs)."""
        fields = {"schedule": self.name, **{k: _int_or(v) for k, v in row.items()}}
        return self.label.format(**fields)


def _int_or(v: Any) -> Any:
    try:
        return int(v) if float(v) == int(v) else v
    except (TypeError, ValueError):
        return v


def _loader(name: str) -> None:
    load_plugins()


SCHEDULES: Registry[ScheduleSpec] = Registry("schedule", loader=_loader)


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Declare an implementation (a built-in one below, or a plug-in's)."""
    for backend, module in spec.modules.items():
        if not module:
            raise ValueError(f"ScheduleSpec {spec.name!r}: no module for backend {backend!r}")
    return SCHEDULES.register(spec.name, spec)


def _here(file: str) -> dict[str, str]:
    return {b: f"{b}.schedules.{file}" for b in ("sim", "real")}


_DRAFTING = frozenset({"schedule.gamma", "lookahead"})  # a chain of γ guesses, γ set per round by the policy
_TREES = frozenset({"schedule.gamma", "schedule.tree_*"})  # trees: γ is the default depth and the context's margin

# Registration order is the order of every list the testbed shows (and of the readers an
# unused setting names).
register(ScheduleSpec(
    "ar", SINGLE, "the target emits one token per forward (the baseline of every speedup)",
    drafts=False, reads=frozenset({"placement.nodes", "network"}), ar_baseline=None, batches=True,
    replays=("sync", "sync_tree", "async", "decentralized"), trace_from="sync",
    color="#999999", modules=_here("ar")))
register(ScheduleSpec(
    "sync", SINGLE, "the draft proposes γ tokens, the target verifies them in one forward "
    "(Leviathan et al. 2023, Algorithm 1)",
    reads=_DRAFTING, replays=("sync",), trace_from="sync", batches=True, color="#0072B2",
    modules=_here("sync")))
register(ScheduleSpec(
    "sync_tree", TREE, "a draft token tree verified serially, draft and target sharing all "
    "devices (SwiftSpec-base)",
    tree_of="sync", tree=True, reads=_TREES, replays=("sync_tree",),
    trace_from="sync_tree", batches=True, timeline=True, color="#000000", modules=_here("sync_tree")))
register(ScheduleSpec(
    "async", TWO_GROUPS, "the draft group grows a tree while the target group verifies the "
    "previous subtree (SwiftSpec 2025)",
    tree=True, reads=_TREES, ar_baseline=ALL_DEVICES, replays=("async", "sync_tree"),
    trace_from="sync", concurrent=True, batches=True, timeline=True, color="#E69F00", label="t{target_gpus}",
    modules=_here("async_tree")))
register(ScheduleSpec(
    "decentralized", PIPELINE, "the target is a pipeline over N nodes on WAN links; a draft "
    "window is verified per round trip (DSD 2025)",
    reads=_DRAFTING | {"schedule.adaptive", "schedule.lambda*", "schedule.tau", "schedule.draft_topk",
                       "placement.nodes", "network"},
    ar_baseline=SAME_PIPELINE, replays=("decentralized",), trace_from="decentralized",
    batches=True, timeline=True, color="#009E73", modules=_here("decentralized")))

BASELINE = "ar"  # the implementation every speedup is measured against


# ------------------------------------------------------------------------------------ plug-ins
_plugins_loaded: set[str] = set()


def load_plugin(module: str) -> None:
    """Import a plug-in package: its ``__init__`` registers its ``ScheduleSpec``(s). One that
    cannot be imported is a ``ConfigError`` naming ``SPECBED_PLUGINS``."""
    if module in _plugins_loaded:
        return
    try:
        importlib.import_module(module)
        _plugins_loaded.add(module)
        named = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
        if module not in named:  # the processes this one starts (workers, spawned ranks) load it too
            os.environ[PLUGINS_ENV] = ",".join([*named, module])
    except ImportError as e:
        from testbed.config import ConfigError

        raise ConfigError(PLUGINS_ENV, module, f"an importable schedule plug-in package ({e}); "
                          "put its directory on PYTHONPATH or remove it from "
                          f"{PLUGINS_ENV}") from None


def load_plugins(value: str | None = None) -> None:
    """The plug-ins named in ``SPECBED_PLUGINS`` (or ``value``), comma separated."""
    raw = os.environ.get(PLUGINS_ENV, "") if value is None else value
    for module in (m.strip() for m in raw.split(",")):
        if module:
            load_plugin(module)


def specs() -> list[ScheduleSpec]:
    """Every declaration, the plug-ins' included, in registration order."""
    load_plugins()
    return SCHEDULES.loaded()


def plugin_conf_dirs() -> list[str]:
    """The conf directories of the plug-ins loaded (hydra_plugins/specbed_plugins adds them to
    Hydra's search path)."""
    return [s.conf_dir for s in specs() if s.conf_dir]


# ------------------------------------------------------------------------------- the table
def schedule_names() -> tuple[str, ...]:
    """The values of ``schedule=``: every implementation that is no tree variant, sorted."""
    return tuple(sorted(s.name for s in specs() if s.tree_of is None))


def all_implementations() -> tuple[str, ...]:
    """Every implementation: each schedule (sorted), then its tree variant."""
    out = []
    for name in schedule_names():
        variant = tree_variant(name)
        out += [name] if variant is None else [name, variant.name]
    return tuple(out)


def spec(impl: str) -> ScheduleSpec:
    """The declaration of an implementation; ``UnknownName`` (a KeyError) when there is none."""
    return SCHEDULES.get(impl)


def find(impl: Any) -> ScheduleSpec | None:
    """The declaration, or None for an unknown name (a report reading old or foreign runs)."""
    return SCHEDULES.find(str(impl))


def tree_variant(name: str) -> ScheduleSpec | None:
    return next((s for s in specs() if s.tree_of == name), None)


def implementation(name: str, tree: bool) -> str:
    """The implementation a schedule name and its tree flag select (``sync`` + tree -> sync_tree)."""
    variant = tree_variant(name) if tree else None
    return variant.name if variant else name


def schedule_impl(exp: Any) -> str:
    """The implementation an experiment runs (its summary's ``schedule``)."""
    return implementation(exp.schedule.name, exp.schedule.tree)


def spec_of(exp: Any) -> ScheduleSpec:
    """The declaration of the implementation ``exp`` runs."""
    return spec(schedule_impl(exp))


def names_where(predicate: Callable[[ScheduleSpec], bool]) -> tuple[str, ...]:
    """The implementations whose declaration satisfies ``predicate``, in registration order."""
    return tuple(s.name for s in specs() if predicate(s))


def runs_on(backend: str, impl: str) -> bool:
    s = find(impl)
    return s is not None and s.runs_on(backend)


def implementations(backend: str) -> tuple[str, ...]:
    """The implementations a backend runs, in ``all_implementations`` order."""
    return tuple(i for i in all_implementations() if runs_on(backend, i))


def describe(impl: str) -> str:
    """How a user selects an implementation: ``sync_tree`` -> ``sync (tree)``."""
    s = find(impl)
    return f"{s.tree_of} (tree)" if s is not None and s.tree_of else impl


def unsupported(backend: str, name: str, tree: bool) -> str | None:
    """Why ``schedule=name`` (with ``schedule.tree``) cannot run on ``backend``, else None.
    A tree flag that selects no tree implementation is refused off the simulator (a real run
    would silently decode without a tree)."""
    impl = implementation(name, tree)
    ignored_tree = tree and tree_variant(name) is None and backend != "sim"
    if runs_on(backend, impl) and not ignored_tree:
        return None
    mine = implementations(backend)
    allowed = []
    for i in mine:
        variant = tree_variant(i)
        allowed.append(describe(i) + (" (without tree)" if variant is not None and variant.name not in mine else ""))
    others = [describe(i) for i in all_implementations() if i not in mine]
    return f"{' or '.join(allowed)} with backend={backend}; {', '.join(others)} run on backend=sim"


# ---------------------------------------------------------- a backend's implementations
S = TypeVar("S", bound=Callable[..., Any])


def implementation_registry(backend: str) -> Registry[S]:
    """A backend's schedules by implementation name: each implementation's module (its
    declaration's ``modules[backend]``) decorates its entry point with the registry's
    ``register(impl)``; ``get`` imports that module on first use."""
    kind = f"schedule on backend={backend}"

    def load(impl: str) -> None:
        s = find(impl)
        if s is None or not s.runs_on(backend):
            raise UnknownName(kind, impl, implementations(backend),
                              f"schedule {impl!r} does not run on backend={backend}: "
                              f"allowed {', '.join(implementations(backend))}")
        importlib.import_module(s.modules[backend])

    return Registry(kind, loader=load)
