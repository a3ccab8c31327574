"""Built-in report sections: runs table, throughput, theory check, acceptance, timeline."""

from __future__ import annotations

import pandas as pd

from testbed.metrics import HEADLINE, KEY_FIELDS
from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.schedule_kinds import chains, drafting, without_draft
from testbed.report.style import (
    SCHEDULE_COLORS,
    colors_for,
    human,
    legend_outside,
    savefig,
    seaborn,
)
from testbed.theory import leviathan_speedup

HIST_LINES = 6  # up to this many runs: one histogram line each; more: a heatmap of every run


def varying_keys(df: pd.DataFrame) -> list[str]:
    """Experiment-key columns (and sweep knobs) that differ between runs."""
    cols = [c for c in (*KEY_FIELDS, "alpha_config", "sim_c", "cost_model", "oracle", "tau",
                        "latency_ms") if c in df.columns]
    return [c for c in cols if df[c].astype(str).nunique() > 1]


SHORT = {"target_gpus": "t", "draft_gpus": "d", "gamma": "γ", "latency_ms": "lat ms",
         "alpha_config": "α", "temperature": "T", "schedule": "", "pair": "", "hardware": "",
         "workload": "", "backend": ""}


def run_label(row: pd.Series, keys: list[str]) -> str:
    """A short label of what differs: `async t2 d6 γ4`, values without their key where the value
    says what it is (schedule, pair, hardware); unset values (NaN) left out."""
    parts = []
    for k in keys or ["schedule"]:
        v = row[k]
        if v is None or (isinstance(v, float) and v != v):
            continue
        v = f"{v:g}" if isinstance(v, float) else str(v)
        name = SHORT.get(k, k)
        parts.append(v if name == "" else f"{name}={v}" if len(name) > 1 and name != "γ" else f"{name}{v}")
    return " ".join(parts)


@section(10, "Runs")
def runs_table(ctx: ReportContext) -> str:
    df = ctx.df
    keys = varying_keys(df)
    fixed = [k for k in KEY_FIELDS if k in df.columns and k not in keys]
    lines = []
    if fixed:
        first = df.iloc[0]
        lines.append("Common to all runs: " + ", ".join(f"{human(k)} `{first[k]}`" for k in fixed) + "\n")
    cols = keys + [c for c in HEADLINE if c in df.columns]
    table = df[cols]
    if set(df["hardware"]) == {"local"}:  # this machine: a device is a core
        table = table.rename(columns={"target_gpus": "target cores", "draft_gpus": "draft cores"})
    lines.append(markdown_table(table))
    return "\n".join(lines)


@section(20, "Throughput")
def throughput(ctx: ReportContext) -> str:
    if not ctx.draw:
        return ""
    import matplotlib.pyplot as plt

    df = ctx.df.copy()
    keys = varying_keys(df)
    if gamma_sweep(df):
        df = df[drafting(df)].copy()  # `ar` drafts nothing: γ = 0 is no point of it
        hue = next((k for k in varying_keys(df) if k != "gamma"), None)
        sns = seaborn()
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        palette = (colors_for(list(df[hue].astype(str).unique())) if hue == "schedule"
                   else "viridis" if hue else None)
        if hue == "schedule":
            df[hue] = df[hue].astype(str)
        for ax, metric in zip(axes, ("tokens_per_s", "speedup")):
            sns.lineplot(data=df, x="gamma", y=metric, hue=hue, marker="o", ax=ax, palette=palette)
            ax.set_xlabel("γ (draft tokens per round)")
            ax.set_ylabel(human(metric))
            ax.set_ylim(bottom=0)
            ax.set_title(f"{human(metric)} against γ")
            if hue and ax.get_legend() is not None:
                ax.get_legend().set_title(human(hue))
        theory = _theorem_curves(df)
        if theory is not None:
            sns.lineplot(data=theory, x="gamma", y="speedup", hue=hue if hue in theory else None,
                         palette=palette if hue in theory else None, linestyle="--",
                         ax=axes[1], legend=False)
            axes[1].set_title("speedup vs γ (dashed: Theorem 3.8)")
        fig.tight_layout()
        savefig(fig, ctx.figure_path("throughput_vs_gamma.png"))
        best = df.loc[df.groupby(hue)["tokens_per_s"].idxmax()] if hue else df.loc[[df["tokens_per_s"].idxmax()]]
        show = [c for c in (hue, "gamma", "tokens_per_s", "speedup") if c]
        return ("![throughput vs gamma](throughput_vs_gamma.png)\n\nBest γ:\n\n"
                + markdown_table(best[show]))
    # one horizontal bar per run (labels readable, the figure grows downwards), the `ar`
    # baseline of the same run as a grey tick on its bar
    df["run"] = [run_label(r, keys) for _, r in df.iterrows()]
    df = df.iloc[::-1]
    # as wide as the longest label needs (8 pt: ~0.07 in a character) beside a 4.5 in plot,
    # so that the title centred over the plot stays inside the figure
    width = max(7.0, 4.5 + 0.07 * max(map(len, df["run"])))
    fig, ax = plt.subplots(figsize=(width, max(2.4, 1.2 + 0.3 * len(df))))
    colors = [SCHEDULE_COLORS.get(str(s), "#0072B2") for s in df["schedule"]]
    ax.barh(range(len(df)), df["tokens_per_s"], color=colors, height=0.7)
    base = pd.to_numeric(df.get("ar_tokens_per_s"), errors="coerce")
    if base is not None and base.notna().any():
        ax.scatter(base, range(len(df)), marker="|", s=200, color="black", zorder=3, label="ar baseline")
        legend_outside(ax, fontsize=8)
    ax.set_yticks(range(len(df)), df["run"], fontsize=8)
    ax.set_xlim(left=0)
    ax.set_xlabel("decode tokens/s (prefill excluded)")
    ax.set_title("throughput per run (colour: schedule)")
    fig.tight_layout()
    savefig(fig, ctx.figure_path("throughput.png"))
    return "![throughput](throughput.png)"


def gamma_sweep(df: pd.DataFrame) -> bool:
    """Whether throughput against γ means something here: one schedule (`ar` aside, which drafts
    nothing) run at more than one γ, more than two runs in all."""
    drafted = df[drafting(df)]
    return (len(drafted) > 2 and drafted["schedule"].nunique() == 1
            and drafted["gamma"].nunique() > 1)


def _theorem_curves(df: pd.DataFrame) -> pd.DataFrame | None:
    """Theorem 3.8 for every analytic+iid sync run (same α, γ, c), for dashed overlays."""
    if not {"cost_model", "oracle", "alpha_config", "sim_c"} <= set(df.columns):
        return None
    m = df[(df["cost_model"] == "analytic") & (df["oracle"] == "iid") & df["schedule"].isin(chains())].copy()
    if m.empty:
        return None
    m["speedup"] = [leviathan_speedup(a, int(g), c) for a, g, c in zip(m["alpha_config"], m["gamma"], m["sim_c"])]
    return m


@section(30, "Theory check (Leviathan et al. Theorem 3.8)")
def theory_check(ctx: ReportContext) -> str:
    df = ctx.df
    if not {"cost_model", "oracle", "alpha_config", "sim_c"} <= set(df.columns):
        return ""
    m = df[(df["cost_model"] == "analytic") & (df["oracle"] == "iid") & df["schedule"].isin(chains())]
    if m.empty:
        return ""
    rows = []
    for _, r in m.iterrows():
        exp_speed = leviathan_speedup(r["alpha_config"], int(r["gamma"]), r["sim_c"])
        exp_len = leviathan_speedup(r["alpha_config"], int(r["gamma"]), 0.0)
        rows.append({"alpha": r["alpha_config"], "gamma": r["gamma"], "c": r["sim_c"],
                     "speedup (sim)": r["speedup"], "speedup (Thm 3.8)": exp_speed,
                     "err %": 100 * (r["speedup"] - exp_speed) / exp_speed,
                     "accepted len (sim)": r["mean_accepted_len"], "E[len] (eq. 1)": exp_len,
                     "len err %": 100 * (r["mean_accepted_len"] - exp_len) / exp_len})
    return ("Simulated with `sim.cost_model=analytic acceptance=iid`; expected values from "
            "(1−α^(γ+1))/((1−α)(γc+1)) and eq. (1).\n\n" + markdown_table(pd.DataFrame(rows)))


@section(40, "Accepted length per verification")
def acceptance_hist(ctx: ReportContext) -> str:
    if not ctx.draw:
        return ""
    import matplotlib.pyplot as plt

    keys = varying_keys(ctx.df)
    dists: dict[str, pd.Series] = {}
    for run, (_, row) in zip(ctx.runs, ctx.df.iterrows()):
        if row["schedule"] in without_draft():
            continue
        r = run.frame("rounds")
        if r.empty:
            continue
        dists[run_label(row, keys)] = (r["accepted"] + 1).value_counts(normalize=True).sort_index()
    if not dists:
        return ""
    table = pd.DataFrame(dists).T.fillna(0.0).sort_index(axis=1)
    if len(table) <= HIST_LINES:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        colors = colors_for(list(table.index))
        for label, row in table.iterrows():
            ax.step(row.index, row.values, where="mid", label=label, color=colors[label])
        ax.set_ylabel("share of verifications")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    else:  # every run: one row each, colour = share of verifications
        # constrained layout: tight_layout does not make room for a colour bar's label
        fig, ax = plt.subplots(figsize=(8, 1.4 + 0.28 * len(table)), layout="constrained")
        fig.get_layout_engine().set(w_pad=0.1, h_pad=0.1)  # inches: the margin tight_layout leaves
        im = ax.imshow(table.values, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks(range(len(table)), table.index, fontsize=7)
        ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns])
        fig.colorbar(im, ax=ax, label="share of verifications")
    ax.set_xlabel("tokens per verification (accepted + bonus)")
    ax.set_title(f"accepted length, {len(table)} run(s)")
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    savefig(fig, ctx.figure_path("accepted_length.png"))
    return "![accepted length](accepted_length.png)"


@section(50, "Timeline")
def timeline(ctx: ReportContext) -> str:
    from testbed.report.sections_sim import draws_timeline

    if not ctx.draw or len(ctx.runs) != 1 or draws_timeline(ctx.df):  # async/trees/pipelines: sections_sim
        return ""
    import matplotlib.pyplot as plt

    tl = ctx.runs[0].frame("timeline")
    if tl.empty:
        return ""
    first = tl[(tl["request_id"] == tl["request_id"].min()) & (tl["kind"] != "prefill")]
    first = first[first["round"] < first["round"].min() + 12]
    if first.empty:
        return ""
    t0 = first["start_s"].min()
    resources = sorted(first["resource"].unique())
    kinds = sorted(first["kind"].unique())
    colors = colors_for(kinds)
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(resources) + 1.8))
    for i, res in enumerate(resources):
        spans = first[first["resource"] == res]
        for kind, g in spans.groupby("kind"):
            ax.broken_barh(list(zip((g["start_s"] - t0) * 1e3, (g["end_s"] - g["start_s"]) * 1e3)),
                           (i - 0.4, 0.8), facecolors=colors[kind], label=kind, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(resources)), resources)
    ax.set_xlabel("ms since the first decode round")
    legend_outside(ax, fontsize=8)
    ax.set_title("first rounds of the first request")
    fig.tight_layout()
    savefig(fig, ctx.figure_path("timeline.png"))
    return "![timeline](timeline.png)"


@section(60, "Telemetry (real runs)")
def telemetry(ctx: ReportContext) -> str:
    """CPU utilisation and resident memory (psutil), GPU utilisation/memory (NVML) per real run."""
    rows = []
    keys = varying_keys(ctx.df)
    for run, (_, row) in zip(ctx.runs, ctx.df.iterrows()):
        t = run.frame("telemetry")
        if t.empty:
            continue
        out = {"run": run_label(row, keys), "samples": len(t),
               "cpu % (machine)": t["cpu_percent"].mean(), "cpu % (process)": t["process_cpu_percent"].mean(),
               "RSS max MB": t["rss_mb"].max()}
        if "gpu_util_percent" in t:
            out |= {"GPU util %": t["gpu_util_percent"].mean(), "GPU mem max MB": t["gpu_mem_used_mb"].max()}
        rows.append(out)
    if not rows:
        return ""
    return ("Sampled every 0.25 s during the schedule (not the `ar` baseline); "
            "cpu % (process) counts one core as 100.\n\n" + markdown_table(pd.DataFrame(rows)))
