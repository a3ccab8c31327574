"""Reports over one or many run directories: report.md, report.html and PNG figures.

``build_report(paths, out_dir)`` reads every complete run below ``paths`` and runs each
registered *section* (testbed/report/sections.py and friends). A section receives the summaries
DataFrame and the runs, may write figures into ``out_dir``, and returns markdown (or "" when it
has nothing to say for these runs), so a sweep's report shows what that sweep varied.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.report.context import SECTIONS, ReportContext, Section, markdown_table
from testbed.results import Run, RunDirError, find_runs, summaries_frame

ReportError = RunDirError


def load_sections(runs: list[Run]) -> None:
    """Register the report sections these runs can use (all but the sim-vs-real ones for none)."""
    import testbed.report.sections  # noqa: F401  (registers the built-in sections)
    import testbed.report.sections_load  # noqa: F401  (speculation under load: +sweep=load)
    import testbed.report.sections_lookahead  # noqa: F401  (lookahead policies: DISCO's Table 1)
    import testbed.report.sections_repeats  # noqa: F401  (real.repeats: intervals, machine state)
    import testbed.report.sections_sim  # noqa: F401  (GPU split, DSD, Gantt charts)
    import testbed.report.sections_wan  # noqa: F401  (DSD measured beside predicted)

    if {r.summary.get("backend") for r in runs} >= {"sim", "real"}:
        import testbed.report.sections_split  # noqa: F401  (gpu_split: predicted vs measured)
        import testbed.report.sections_validate  # noqa: F401  (sim vs real: validation.csv, parity)


def build_report(paths: Iterable[Path | str], out_dir: Path | str, *, figures: bool = True,
                 workers: int = 1, pool: Callable[[int], dict[str, Any]] | None = None) -> Path:
    """Write report.md, report.html and figures into out_dir; return the report.md path.
    ``workers`` > 1 draws the sections' figures in that many processes (a sweep's report: most
    of its time is matplotlib laying out text, one section at a time); ``pool(n)`` gives joblib's
    ``Parallel`` arguments for them (a sweep passes its warm workers: testbed.app.worker_pool), else
    ``n`` fresh loky workers.

    Everything is written into a temporary directory beside the output first and moved in only
    when the whole report succeeded: a failure (a corrupt run) leaves `out_dir` as it was."""
    paths = list(paths)
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no complete runs (directories with summary.json) under {', '.join(map(str, paths))}")
    if figures:
        import matplotlib

        matplotlib.use("Agg")
    load_sections(runs)
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
    try:
        ctx = ReportContext(df=summaries_frame(runs), runs=runs, out_dir=tmp, figures=[], draw=figures)
        failed = _failed_jobs(paths)
        parts = [f"# Speculative decoding testbed report\n\n{len(runs)} run(s) from "
                 f"{', '.join(sorted({str(Path(p)) for p in paths}))}"
                 + (f"; {len(failed)} failed job(s)" if failed else "") + "\n"]
        if not figures:
            parts.append("Tables only; figures: `python -m testbed.report "
                         f"{' '.join(map(str, paths))}` (or `report.figures=true`).\n")
        if failed:
            parts.append("## Failed jobs\n\n" + markdown_table(pd.DataFrame(failed)) + "\n")
        for (_, title, _fn), body in zip(SECTIONS, _render(ctx, workers, pool)):
            if body:
                parts.append(f"## {title}\n\n{body}\n")
        md = "\n".join(parts)
        (tmp / "report.md").write_text(md)
        (tmp / "report.html").write_text(to_html(md))
        for f in tmp.iterdir():  # the finished report replaces the old one file by file
            os.replace(f, out / f.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return out / "report.md"


def _render(ctx: ReportContext, workers: int, pool: Callable[[int], dict[str, Any]] | None) -> list[str]:
    """Every section's markdown, in order; in ``workers`` processes when drawing figures."""
    fns = [fn for _, _, fn in SECTIONS]
    if workers <= 1 or not ctx.draw or len(fns) <= 1:
        return [fn(ctx) for fn in fns]
    from joblib import Parallel, delayed

    n = min(workers, len(fns))
    kwargs = pool(n) if pool is not None else {"n_jobs": n, "backend": "loky"}
    return Parallel(**kwargs)(delayed(_render_section)(fn, ctx) for fn in fns)


def _render_section(fn: Section, ctx: ReportContext) -> str:
    import matplotlib

    matplotlib.use("Agg")
    return fn(ctx)


def _failed_jobs(paths: list[Path | str]) -> list[dict[str, str]]:
    from testbed.app.sweeps import FAILED, failures

    out = []
    for p in map(Path, paths):
        if p.is_dir() and any(p.glob(f"*/{FAILED}")):
            out += [{"job": f["job"], "overrides": f["overrides"], "error": f["error"]}
                    for f in failures(p)]
    return out


# a table as wide as the page at most: its headers wrap, and what still does not fit scrolls
CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0;font-size:90%;display:block;max-width:100%;overflow-x:auto}
th,td{border:1px solid #bbb;padding:3px 8px}th{background:#eee;text-align:left;vertical-align:bottom}td{text-align:right}img{max-width:100%;height:auto;border:1px solid #ddd}
code{background:#f3f3f3;padding:0 3px}"""


def to_html(md: str) -> str:
    """report.md rendered (markdown-it, with tables); every figure links to its full size."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(md)
    body = re.sub(r'<img src="([^"]+)" alt="([^"]*)" />',
                  lambda m: f'<a href="{m.group(1)}"><img src="{m.group(1)}" alt="{m.group(2)}" '
                            f'title="click for full size"></a>', body)
    return (f"<!doctype html><meta charset=utf-8><title>testbed report</title><style>{CSS}</style>\n"
            + body)
