"""Report section "Speculation under load" (`+sweep=load`; any runs at several loads).

Runs under load (testbed/arrivals.py) carry a load (``rate`` of Poisson arrivals or closed-loop
``concurrency``) and the serving metrics (testbed/metrics.py ``load_metrics``). Per schedule
variant (``ar``; ``sync`` per static γ; ``sync`` per lookahead policy) and load: the system's
throughput, TPOT and TTFT percentiles, the mean batch, and against `ar` at the same load the
P50 TPOT (``tpot_speedup``: with open arrivals below saturation every schedule's throughput is
the offered load, and what speculation changes is each token's latency) and the throughput
(``load_speedup``). Then the best γ at each load, and the *crossover*: the lowest load from
which no `sync` variant beats `ar` any more (shorter P50 TPOT without losing throughput:
speculation stops paying as batching makes the
target's forwards compute bound and every guess costs real work). Figures: throughput against
P50 TPOT per variant (the serving trade-off), and speedup against load with the crossover marked.
"""

from __future__ import annotations

import pandas as pd

from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.schedule_kinds import chains, drafting, without_draft
from testbed.report.style import savefig
from testbed.schedules import names_where
from testbed.workloads import TRACE_SPLITS


def load_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The runs under load with their load axis (``load``) and variant label, one backend each."""
    if "throughput_tok_s" not in df.columns:
        return df.iloc[0:0]
    d = df[df["throughput_tok_s"].notna()].copy()
    if d.empty:
        return d
    by_rate = d["rate"].notna() if "rate" in d.columns else pd.Series(False, index=d.index)
    d["load"] = d["rate"].where(by_rate, d.get("concurrency"))
    d["load_kind"] = by_rate.map({True: "requests/s", False: "clients"})

    plain, trees = without_draft(), names_where(lambda s: s.tree)

    def variant(r: pd.Series) -> str:
        if r["schedule"] in plain:
            return str(r["schedule"])
        if r["schedule"] in trees:
            return f"{r['schedule']} (d={int(r['gamma'])})"
        if r.get("lookahead", "static") not in (None, "static"):
            return f"{r['schedule']} {r['lookahead']} (γ≤{int(r['gamma'])})"
        return f"{r['schedule']} γ={int(r['gamma'])}"

    d["variant"] = d.apply(variant, axis=1)
    return d.sort_values(["backend", "variant", "load"])


THROUGHPUT_SLACK = 0.99  # a variant that loses more than 1 % of ar's throughput does not pay


def crossover(d: pd.DataFrame) -> float | None:
    """The lowest load from which no speculative variant beats `ar` at the same load any more
    (None: it pays at every load of the grid, or at none). A variant pays where its P50 TPOT is
    shorter than `ar`'s without giving up throughput: below saturation throughput is the offered
    load for both, past it the system's capacity, which speculation may lower."""
    s = d[drafting(d)]
    pays = ((s["tpot_speedup"] > 1) & (s["load_speedup"].fillna(1.0) >= THROUGHPUT_SLACK)).groupby(s["load"]).any()
    pays = pays.sort_index()
    if pays.empty or pays.all() or not pays.any():
        return None
    loads = list(pays.index)
    for i, load in enumerate(loads):
        if not pays[loads[i:]].any():
            return float(load)
    return None


@section(38, "Speculation under load")
def under_load(ctx: ReportContext) -> str:
    d = load_runs(ctx.df)
    if "workload_split" in d.columns:  # a validation's trace runs are the prediction's inputs
        d = d[~((d["backend"] == "real") & d["workload_split"].isin(TRACE_SPLITS))]
    if d.empty or d["load"].nunique() < 2:
        return ""
    out = []
    if set(d["backend"]) >= {"sim", "real"}:
        out.append(predicted_beside_measured(d))
    for (backend, unit), b in d.groupby(["backend", "load_kind"], sort=False):
        rows = [{"variant": r.variant, f"load ({unit})": r.load, "throughput tok/s": r.throughput_tok_s,
                 "TPOT p50 ms": r.tpot_ms_p50, "TPOT p90 ms": r.tpot_ms_p90, "TTFT p50 ms": r.ttft_ms_p50,
                 "mean batch": r.mean_batch, "TPOT × ar": r.tpot_speedup, "throughput × ar": r.load_speedup}
                for r in b.itertuples()]
        out.append(f"**{backend}, load in {unit}** — every variant at every load:\n\n" + markdown_table(pd.DataFrame(rows)))
        static = b[b["schedule"].isin(chains()) & b["variant"].str.contains("γ=")]  # static chains
        static = static[static["tpot_speedup"].notna()]
        if not static.empty:
            best = static.loc[static.groupby("load")["tpot_speedup"].idxmax()]
            out.append("Best static γ per load (by P50 TPOT):\n\n" + markdown_table(pd.DataFrame(
                [{f"load ({unit})": r.load, "best γ": int(r.gamma), "TPOT p50 ms": r.tpot_ms_p50,
                  "TPOT × ar": r.tpot_speedup, "throughput × ar": r.load_speedup} for r in best.itertuples()])))
        x = crossover(b)
        out.append(f"Speculation stops beating `ar` from a load of **{x:g} {unit}** on." if x is not None else
                   "No crossover within the grid: speculation pays at every load, or at none.")
        if ctx.draw:
            _figures(ctx, b, backend=backend, unit=unit, cross=x)
    return "\n\n".join(out)


def predicted_beside_measured(d: pd.DataFrame) -> str:
    """Per variant and load run on both backends: throughput and TPOT predicted (sim) beside
    measured (real) with the signed error, and each backend's crossover."""
    key = ["variant", "load_kind", "load"]
    cols = ["throughput_tok_s", "tpot_ms_p50", "tpot_ms_p90"]
    both = d[d["backend"] == "sim"].groupby(key)[cols].mean().join(
        d[d["backend"] == "real"].groupby(key)[cols].mean(), lsuffix="_sim", rsuffix="_real", how="inner")
    if both.empty:
        return ""
    rows = []
    for (variant, unit, load), r in both.iterrows():
        row = {"variant": variant, "load": f"{load:g} {unit}"}
        for c, name in zip(cols, ("throughput tok/s", "TPOT p50 ms", "TPOT p90 ms")):
            sim, real = r[f"{c}_sim"], r[f"{c}_real"]
            row[f"{name} sim"], row[f"{name} real"] = sim, real
            row[f"{name} err %"] = 100.0 * (sim - real) / real if real else float("nan")
        rows.append(row)
    lines = ["**Predicted beside measured** (sim = `backend=sim`, real = `backend=real`, the same "
             "variant and load):\n", markdown_table(pd.DataFrame(rows), floatfmt="{:.1f}")]
    for unit, b in d.groupby("load_kind"):
        x = {backend: crossover(g) for backend, g in b.groupby("backend")}
        if "sim" in x and "real" in x:
            say = {k: f"{v:g} {unit}" if v is not None else "none in the grid" for k, v in x.items()}
            lines.append(f"Crossover ({unit}): predicted {say['sim']}, measured {say['real']}.")
    return "\n\n".join(lines)


def _figures(ctx: ReportContext, b: pd.DataFrame, *, backend: str, unit: str, cross: float | None) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, v in b.groupby("variant", sort=False):
        v = v.sort_values("load")
        ax1.plot(v["tpot_ms_p50"], v["throughput_tok_s"], marker="o", label=name)
        if drafting(v).all() and v["tpot_speedup"].notna().any():
            ax2.plot(v["load"], v["tpot_speedup"], marker="o", label=name)
    ax1.set_xlabel("TPOT p50 (ms)")
    ax1.set_ylabel("throughput (output tokens/s)")
    ax1.set_title("throughput against latency")
    ax2.axhline(1.0, color="#999999", lw=1)
    if cross is not None:
        ax2.axvline(cross, color="#CC0000", ls="--", lw=1, label=f"crossover {cross:g}")
    if ax2.get_lines()[1:] or cross is not None:  # beyond the reference line (no `ar`: no speedups)
        ax2.set_xscale("log", base=2)
    ax2.set_xlabel(f"load ({unit})")
    ax2.set_ylabel("ar's P50 TPOT / its P50 TPOT, same load")
    ax2.set_title("speculation's speedup against load")
    if ax2.get_legend_handles_labels()[0]:  # no speculative variant (no `ar` to compare): no legend
        ax2.legend(fontsize=7, loc="best")
    ax1.legend(fontsize=7, loc="best")
    fig.tight_layout()
    savefig(fig, ctx.figure_path(f"load_{backend}{'_closed' if unit == 'clients' else ''}.png"))
