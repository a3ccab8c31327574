"""Layout rules (docs/architecture.md): testbed imports no module of sim/ or real/, not even lazily (a backend is
reached through testbed.backends); sim/ and real/ register the same way; the schedule table
(testbed.schedules) agrees with the files, and no code outside it compares schedule names."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

from testbed import backends
from testbed.schedules import (
    SCHEDULES,
    all_implementations,
    implementation,
    implementations,
    runs_on,
    schedule_names,
    unsupported,
)

ROOT = Path(__file__).resolve().parents[1]
BACKEND_PACKAGES = ("sim", "real")


def backend_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import statement of a backend package in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in BACKEND_PACKAGES]
    return found


def test_the_import_finder_sees_lazy_and_from_imports() -> None:
    src = "import os\ndef f():\n    from sim.runtime.engine import run\n    import real.model.weights as w\n"
    assert backend_imports(src) == [(3, "sim.runtime.engine"), (4, "real.model.weights")]
    assert backend_imports("from simpy import Environment\nimport realtime\n") == []


def test_testbed_imports_no_backend_module() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}: {mod}"
                 for path in sorted((ROOT / "testbed").rglob("*.py"))
                 for line, mod in backend_imports(path.read_text())]
    assert offenders == [], "testbed/ must reach backends through testbed.backends:\n" + "\n".join(offenders)


def test_every_schedule_runs_on_the_simulator_and_sync_tree_is_sync_with_a_tree() -> None:
    assert set(schedule_names()) == {p.stem for p in (ROOT / "conf" / "schedule").glob("*.yaml")}
    assert implementation("sync", True) == "sync_tree" and implementation("sync", False) == "sync"
    assert set(implementations("sim")) == set(all_implementations())
    assert {"ar", "sync"} <= set(implementations("real"))
    assert runs_on("real", "decentralized") and not runs_on("sim", "no_such_schedule")
    assert unsupported("sim", "sync", True) is None and unsupported("real", "decentralized", False) is None
    assert unsupported("real", "decentralized", True)  # a tree flag no implementation takes
    assert unsupported("real", "ar", True)  # a tree flag a real run would ignore


@pytest.mark.parametrize("backend", BACKEND_PACKAGES)
def test_backends_register_their_hooks_and_schedules(backend: str) -> None:
    b = backends.get(backend)
    assert b.name == backend and callable(b.run)
    registry = __import__(f"{backend}.schedules", fromlist=["REGISTRY"]).REGISTRY
    for impl in implementations(backend):  # an entry of the shape its layout's runner calls
        entry = registry.get(impl)
        if backend == "real" and SCHEDULES.get(impl).layout == "two_groups":
            from real.schedules import TwoGroups

            assert isinstance(entry, TwoGroups) and all(map(callable, vars(entry).values()))
        else:
            assert callable(entry)
    with pytest.raises(KeyError):
        registry.get("no_such_schedule")
    assert backends.hook("tokenizer") is backends.get("real").tokenizer
    assert backends.get("sim").replay_seconds is not None and backends.get("real").calibrate is not None


def test_every_declared_module_is_a_file_and_every_schedule_file_is_declared() -> None:
    declared = set()
    for spec in SCHEDULES.loaded():
        for backend, module in spec.modules.items():
            path = ROOT / (module.replace(".", "/") + ".py")
            assert path.is_file(), f"{spec.name}: {module} (backend={backend}) has no file {path}"
            declared.add(path)
    files = {p for b in BACKEND_PACKAGES for p in (ROOT / b / "schedules").glob("*.py") if p.stem != "__init__"}
    assert files == declared


SCHEDULE_NAMES = {"ar", "sync", "sync_tree", "async", "decentralized"}


def name_comparisons(source: str) -> list[int]:
    """Lines comparing something with a built-in schedule's name (``x == "sync"``,
    ``x in ("ar", "async")``, ``x.isin(["sync"])``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            consts = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "isin":
            consts = [n for a in node.args for n in ast.walk(a) if isinstance(n, ast.Constant)]
        else:
            continue
        if any(c.value in SCHEDULE_NAMES for c in consts):
            lines.append(node.lineno)
    return lines


def test_no_code_compares_schedule_names_outside_the_declarations() -> None:
    """What a schedule is (its layout, its baseline, the settings it reads, what it replays, how
    the report shows it) is declared once in testbed/schedules.py and read from there."""
    assert name_comparisons('if s.name == "async" or x in ("ar",) or df["s"].isin(["sync"]): pass') == [1, 1, 1]
    assert name_comparisons('e.schedule.name = "sync"\n@register("sync")\ndef f(): pass') == []
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for pkg in ("testbed", *BACKEND_PACKAGES) for path in sorted((ROOT / pkg).rglob("*.py"))
                 if path != ROOT / "testbed" / "schedules.py"
                 for line in name_comparisons(path.read_text())]
    assert offenders == [], "compare a ScheduleSpec field instead:\n" + "\n".join(offenders)


def test_kernels_know_no_experiment() -> None:
    """The operators import nothing of the testbed or a backend."""
    offenders = []
    for path in sorted((ROOT / "specbed_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in ("testbed", *BACKEND_PACKAGES)]
    assert offenders == []


PACKAGES = ("testbed", "sim", "real", "specbed_kernels", "hydra_plugins")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> every module of the packages it imports (see the rule below)."""
    paths = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)

    def known(name: str) -> str | None:  # the module itself, or the package that defines the name
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [known(f"{base}.{a.name}") for a in node.names]
            else:
                continue
            graph.add_edges_from((mod, t) for t in targets if t and t != mod)
    return graph


def test_the_import_graph_sees_lazy_relative_and_submodule_imports() -> None:
    g = import_graph()
    assert g.has_edge("testbed.app.main", "testbed.app.sweeps")  # from testbed.app import sweeps
    assert g.has_edge("specbed_kernels", "specbed_kernels.native") and not g.has_edge("specbed_kernels.native", "specbed_kernels")
    assert g.has_edge("testbed.report", "testbed.report.sections")  # inside a function


def test_no_import_circles() -> None:
    """No module imports, directly or through others, a module that imports it back.

    The rule: every import statement counts, wherever it stands: at the top, inside a function
    (a lazy import only delays a circle, the two modules still cannot be understood or tested
    one without the other) or under ``TYPE_CHECKING``. ``from pkg import name`` depends on the
    module ``pkg.name`` when there is one, else on ``pkg``; the ``__init__`` of a package that
    Python runs before one of its modules is not an edge. A module named as a string (a plug-in
    declared to a ``testbed.registry.Registry``, a backend imported by name) is not an import:
    that is how the testbed reaches what it must not import."""
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(import_graph()))
    assert cycles == [], "import circles:\n" + "\n".join(cycles)


def test_the_packages_are_found_in_the_repository_from_any_directory(tmp_path: Path) -> None:
    """Each top-level package of the project resolves to its folder here, also where the
    repository is not the working directory: an installed distribution of the same name would
    shadow it there (transformers' dependency ``kernels`` once did: the benchmarks and every
    transformers test broke, which is why the operators are ``specbed_kernels``)."""
    import subprocess
    import sys

    code = ("import importlib.util, json; print(json.dumps({p: list(importlib.util.find_spec(p)"
            f".submodule_search_locations) for p in {list(PACKAGES)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    import json

    # a regular package has one location; hydra_plugins is a namespace that others share
    wrong = {p: locations for p, locations in json.loads(out).items()
             if str(ROOT / p) not in locations or (p != "hydra_plugins" and len(locations) != 1)}
    assert wrong == {}, f"shadowed by installed distributions: {wrong}"
