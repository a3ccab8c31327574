"""What a report section is: the context it receives, the ``@section`` registration, and the
markdown table every section writes (testbed/report/__init__.py runs the sections in order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.registry import Registry
from testbed.report.style import human_columns, sig3
from testbed.results import Run


@dataclass
class ReportContext:
    df: pd.DataFrame  # one row per run: summary.json + run_dir
    runs: list[Run]
    out_dir: Path
    figures: list[str]
    draw: bool = True  # False: tables only (the cheap per-run report)

    def figure_path(self, name: str) -> Path:
        self.figures.append(name)
        return self.out_dir / name


Section = Callable[[ReportContext], str]
# (order, title, function) by the function's module and name (testbed.registry); SECTIONS: in order
SECTION_REGISTRY: Registry[tuple[int, str, Section]] = Registry("report section")
SECTIONS: list[tuple[int, str, Section]] = []


def section(order: int, title: str) -> Callable[[Section], Section]:
    """Register a report section; lower `order` comes first (then the order of registration).
    A module imported again keeps its sections' first registration."""
    def deco(fn: Section) -> Section:
        key = f"{fn.__module__}.{fn.__qualname__}"
        if key not in SECTION_REGISTRY:
            SECTION_REGISTRY.register(key, (order, title, fn))
            SECTIONS[:] = sorted(SECTION_REGISTRY.loaded(), key=lambda s: s[0])
        return fn
    return deco


def _empty(v: object) -> bool:
    return v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and v in ("", "—"))


def _escape(text: object) -> str:
    """A table cell's text: a `|` inside it would end the cell (and break the whole table)."""
    return str(text).replace("|", "\\|")


def markdown_table(df: pd.DataFrame, floatfmt: str | None = None) -> str:
    """A markdown table with human column names and 3 significant figures (or `floatfmt`).
    Columns empty in every row (e.g. `tree_shape` of a sweep without trees) are left out, and
    pipes in headers and cells are escaped."""
    def cell(v: object) -> str:
        if _empty(v):
            return "—"
        if isinstance(v, float):
            return floatfmt.format(v) if floatfmt else sig3(v)
        return _escape(v)
    if len(df):
        df = df[[c for i, c in enumerate(df.columns) if not all(map(_empty, df.iloc[:, i]))]]
    cols = human_columns(list(df.columns))
    lines = ["| " + " | ".join(map(_escape, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
