"""Reports over one or many run directories: report.md, report.html and PNG figures.

``build_report(paths, out_dir)`` reads every complete run below ``paths`` and runs each
registered *section* (testbed/report/sections.py and friends). A section receives the summaries
DataFrame and the runs, may write figures into ``out_dir``, and returns markdown (or "" when it
has nothing to say for these runs), so a sweep's report shows what that sweep varied.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.results import Run, find_runs, summaries_frame


@dataclass
class ReportContext:
    df: pd.DataFrame  # one row per run: summary.json + run_dir
    runs: list[Run]
    out_dir: Path
    figures: list[str]

    def figure_path(self, name: str) -> Path:
        self.figures.append(name)
        return self.out_dir / name


Section = Callable[[ReportContext], str]
SECTIONS: list[tuple[int, str, Section]] = []


def section(order: int, title: str) -> Callable[[Section], Section]:
    """Register a report section; lower `order` comes first."""
    def deco(fn: Section) -> Section:
        SECTIONS.append((order, title, fn))
        SECTIONS.sort(key=lambda s: s[0])
        return fn
    return deco


def markdown_table(df: pd.DataFrame, floatfmt: str = "{:.4g}") -> str:
    def cell(v: object) -> str:
        if v is None or (isinstance(v, float) and v != v):
            return "—"
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v).replace("|", "\\|")
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _load_sections() -> None:
    import testbed.report.sections  # noqa: F401  (registers the built-in sections)
    import testbed.report.sections_sim  # noqa: F401  (GPU split, DSD, Gantt charts)
    import testbed.report.sections_validate  # noqa: F401  (sim vs real: validation.csv, parity)


def build_report(paths: Iterable[Path | str], out_dir: Path | str) -> Path:
    """Write report.md, report.html and figures into out_dir; return the report.md path."""
    import matplotlib

    matplotlib.use("Agg")
    _load_sections()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no complete runs (directories with summary.json) under {', '.join(map(str, paths))}")
    ctx = ReportContext(df=summaries_frame(runs), runs=runs, out_dir=out, figures=[])
    parts = [f"# Speculative decoding testbed report\n\n{len(runs)} run(s) from "
             f"{', '.join(sorted({str(Path(p)) for p in paths}))}\n"]
    for _, title, fn in SECTIONS:
        body = fn(ctx)
        if body:
            parts.append(f"## {title}\n\n{body}\n")
    md = "\n".join(parts)
    report = out / "report.md"
    tmp = out / ".report.md.tmp"
    tmp.write_text(md)
    tmp.replace(report)
    (out / "report.html").write_text(_to_html(md))
    return report


def _to_html(md: str) -> str:
    """A plain rendering of our own markdown subset (headings, tables, images, paragraphs)."""
    out, table = [], False
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-:"):
                continue
            if not table:
                out.append("<table border=1 cellspacing=0 cellpadding=3>")
                table = True
            out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
            continue
        if table:
            out.append("</table>")
            table = False
        if m := re.match(r"!\[(.*)\]\((.*)\)", line):
            out.append(f'<p><img src="{html.escape(m.group(2))}" alt="{html.escape(m.group(1))}" width=720></p>')
        elif m := re.match(r"(#+) (.*)", line):
            n = len(m.group(1))
            out.append(f"<h{n}>{html.escape(m.group(2))}</h{n}>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    if table:
        out.append("</table>")
    return "<!doctype html><meta charset=utf-8><title>testbed report</title>\n" + "\n".join(out) + "\n"
