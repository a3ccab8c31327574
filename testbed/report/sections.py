"""Built-in report sections: runs table, throughput, theory check, acceptance, timeline."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from testbed.metrics import HEADLINE, KEY_FIELDS
from testbed.report import ReportContext, markdown_table, section
from testbed.theory import leviathan_speedup

MAX_RUN_PLOTS = 8


def varying_keys(df: pd.DataFrame) -> list[str]:
    """Experiment-key columns (and sweep knobs) that differ between runs."""
    cols = [c for c in (*KEY_FIELDS, "alpha_config", "sim_c", "cost_model", "oracle", "tau",
                        "latency_ms") if c in df.columns]
    return [c for c in cols if df[c].astype(str).nunique() > 1]


def run_label(row: pd.Series, keys: list[str]) -> str:
    keys = keys or ["schedule"]
    return ", ".join(f"{k}={row[k]}" for k in keys)


@section(10, "Runs")
def runs_table(ctx: ReportContext) -> str:
    df = ctx.df
    keys = varying_keys(df)
    fixed = [k for k in KEY_FIELDS if k in df.columns and k not in keys]
    lines = []
    if fixed:
        first = df.iloc[0]
        lines.append("Common to all runs: " + ", ".join(f"`{k}={first[k]}`" for k in fixed) + "\n")
    cols = keys + [c for c in HEADLINE if c in df.columns]
    lines.append(markdown_table(df[cols]))
    return "\n".join(lines)


@section(20, "Throughput")
def throughput(ctx: ReportContext) -> str:
    df = ctx.df.copy()
    keys = varying_keys(df)
    if "gamma" in keys and len(df) > 2:
        hue = next((k for k in keys if k != "gamma"), None)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, metric in zip(axes, ("tokens_per_s", "speedup")):
            sns.lineplot(data=df, x="gamma", y=metric, hue=hue, marker="o", ax=ax,
                         palette="viridis" if hue else None)
            ax.set_title(f"{metric} vs γ")
        theory = _theorem_curves(df)
        if theory is not None:
            sns.lineplot(data=theory, x="gamma", y="speedup", hue=hue if hue in theory else None,
                         palette="viridis" if hue in theory else None, linestyle="--",
                         ax=axes[1], legend=False)
            axes[1].set_title("speedup vs γ (dashed: Theorem 3.8)")
        fig.tight_layout()
        fig.savefig(ctx.figure_path("throughput_vs_gamma.png"), dpi=110)
        plt.close(fig)
        best = df.loc[df.groupby(hue)["tokens_per_s"].idxmax()] if hue else df.loc[[df["tokens_per_s"].idxmax()]]
        show = [c for c in (hue, "gamma", "tokens_per_s", "speedup") if c]
        return ("![throughput vs gamma](throughput_vs_gamma.png)\n\nBest γ:\n\n"
                + markdown_table(best[show]))
    df["run"] = [run_label(r, keys) for _, r in df.iterrows()]
    rows = [{"run": r["run"], "decoding": r["schedule"], "tokens_per_s": r["tokens_per_s"]}
            for _, r in df.iterrows()]
    rows += [{"run": r["run"], "decoding": "ar baseline", "tokens_per_s": r["ar_tokens_per_s"]}
             for _, r in df.iterrows() if r.get("ar_tokens_per_s") and r["schedule"] != "ar"]
    plot = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(df) + 3), 3.6))
    sns.barplot(data=plot, x="run", y="tokens_per_s", hue="decoding", ax=ax)
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=20)
    ax.set_title("decode tokens/s (prefill excluded)")
    fig.tight_layout()
    fig.savefig(ctx.figure_path("throughput.png"), dpi=110)
    plt.close(fig)
    return "![throughput](throughput.png)"


def _theorem_curves(df: pd.DataFrame) -> pd.DataFrame | None:
    """Theorem 3.8 for every analytic+iid sync run (same α, γ, c), for dashed overlays."""
    if not {"cost_model", "oracle", "alpha_config", "sim_c"} <= set(df.columns):
        return None
    m = df[(df["cost_model"] == "analytic") & (df["oracle"] == "iid") & (df["schedule"] == "sync")].copy()
    if m.empty:
        return None
    m["speedup"] = [leviathan_speedup(a, int(g), c) for a, g, c in zip(m["alpha_config"], m["gamma"], m["sim_c"])]
    return m


@section(30, "Theory check (Leviathan et al. Theorem 3.8)")
def theory_check(ctx: ReportContext) -> str:
    df = ctx.df
    if not {"cost_model", "oracle", "alpha_config", "sim_c"} <= set(df.columns):
        return ""
    m = df[(df["cost_model"] == "analytic") & (df["oracle"] == "iid") & (df["schedule"] == "sync")]
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
    frames = []
    keys = varying_keys(ctx.df)
    for run, (_, row) in zip(ctx.runs[:MAX_RUN_PLOTS], ctx.df.iterrows()):
        if row["schedule"] == "ar":
            continue
        r = run.frame("rounds")
        if r.empty:
            continue
        frames.append(pd.DataFrame({"tokens per verification": r["accepted"] + 1,
                                    "run": run_label(row, keys)}))
    if not frames:
        return ""
    data = pd.concat(frames, ignore_index=True)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    sns.histplot(data=data, x="tokens per verification", hue="run", discrete=True,
                 stat="probability", common_norm=False, element="step", ax=ax)
    fig.tight_layout()
    fig.savefig(ctx.figure_path("accepted_length.png"), dpi=110)
    plt.close(fig)
    note = f" (first {MAX_RUN_PLOTS} runs)" if len(ctx.runs) > MAX_RUN_PLOTS else ""
    return f"![accepted length](accepted_length.png){note}"


@section(50, "Timeline")
def timeline(ctx: ReportContext) -> str:
    from testbed.report.sections_sim import draws_timeline

    if len(ctx.runs) != 1 or draws_timeline(ctx.df):  # async/trees/pipelines: sections_sim
        return ""
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
    colors = dict(zip(kinds, sns.color_palette("tab10", len(kinds))))
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(resources) + 1.5))
    for i, res in enumerate(resources):
        spans = first[first["resource"] == res]
        for kind, g in spans.groupby("kind"):
            ax.broken_barh(list(zip((g["start_s"] - t0) * 1e3, (g["end_s"] - g["start_s"]) * 1e3)),
                           (i - 0.4, 0.8), facecolors=colors[kind], label=kind, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(resources)), resources)
    ax.set_xlabel("ms since the first decode round")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_title("first rounds of the first request")
    fig.tight_layout()
    fig.savefig(ctx.figure_path("timeline.png"), dpi=110)
    plt.close(fig)
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
            "`cpu % (process)` counts one core as 100.\n\n" + markdown_table(pd.DataFrame(rows)))
