"""Report section for runs measured with ``real.repeats=N``: medians with their 95% intervals
(error bars), and the measurements taken while the machine changed under them."""

from __future__ import annotations

import pandas as pd

from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.sections import run_label, varying_keys
from testbed.report.style import savefig

FIGURES = ("tokens_per_s", "tpot_ms", "speedup")


def _interval(row: pd.Series, metric: str) -> str:
    value, ci = row.get(f"{metric}_median"), row.get(f"{metric}_ci95")
    if not isinstance(ci, list | tuple) or value is None or value != value:
        return ""
    return f"{value:.3g} [{ci[0]:.3g}, {ci[1]:.3g}]"


@section(15, "Repeated measurements (median, 95% interval)")
def repeated(ctx: ReportContext) -> str:
    if "repeats" not in ctx.df.columns:
        return ""
    df = ctx.df[pd.to_numeric(ctx.df["repeats"], errors="coerce") > 1]
    if df.empty:
        return ""
    keys = varying_keys(ctx.df)
    rows = []
    for _, r in df.iterrows():
        flags = r.get("machine_changed")
        rows.append({"run": run_label(r, keys), "repeats": int(r["repeats"]),
                     **{m: _interval(r, m) for m in FIGURES},
                     "machine changed": "; ".join(flags) if isinstance(flags, list) and flags else ""})
    out = ["Median over prompts × repeats, interleaved with the `ar` baseline; 95% two-stage "
           "bootstrap interval in brackets. A run listed under \"machine changed\" had its load "
           "average, CPU clock or read bandwidth move during a measurement: read it with care.\n",
           markdown_table(pd.DataFrame(rows))]
    if ctx.draw:
        out.append(_error_bars(ctx, df, keys))
    return "\n".join(out)


def _error_bars(ctx: ReportContext, df: pd.DataFrame, keys: list[str]) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), max(2.4, 1 + 0.35 * len(df))))
    labels = [run_label(r, keys) for _, r in df.iterrows()]
    for ax, metric in zip(axes, FIGURES):
        med = pd.to_numeric(df.get(f"{metric}_median"), errors="coerce")
        ci = [c if isinstance(c, list | tuple) else [float("nan")] * 2 for c in df.get(f"{metric}_ci95", [])]
        lo = [m - c[0] for m, c in zip(med, ci)]
        hi = [c[1] - m for m, c in zip(med, ci)]
        ax.errorbar(med, range(len(df)), xerr=[lo, hi], fmt="o", capsize=4)
        ax.set_yticks(range(len(df)), labels if ax is axes[0] else [""] * len(df), fontsize=8)
        ax.set_title(metric.replace("_", " "))
    fig.tight_layout()
    savefig(fig, ctx.figure_path("repeats_error_bars.png"))
    return "![medians with 95% intervals](repeats_error_bars.png)"
