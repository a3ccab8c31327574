"""Report sections for the SwiftSpec and DSD schedules: GPU split, decentralized/WAN, Gantt charts.

- "GPU split": tokens/s against the number of target GPUs (the rest draft) of `async`, per pair,
  beside the serial baselines `sync` and `sync_tree` on the whole node; the best marked; a table
  with every split of every pair.
- "Decentralized speculative decoding": speedup against link latency per node count, the effect
  of the relaxation τ, DSD eq. (5)'s communication reduction with the measured accepted length,
  and — for analytic/iid runs — the simulated speedup against DSD's closed form.
- "Timeline": per-resource Gantt rows (draft, target, pipeline stages, links) for the schedules
  whose point is overlap or communication, with each resource's busy share of the decode time.
"""

from __future__ import annotations

import math

import pandas as pd

from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.style import (
    SCHEDULE_COLORS,
    colors_for,
    device_word,
    grid,
    legend_outside,
    savefig,
    seaborn,
)
from testbed.results import Run
from testbed.schedules import TWO_GROUPS, find, names_where

MAX_GANTT_RUNS = 6
GANTT_ROUNDS = 8


def timeline_schedules() -> tuple[str, ...]:
    """The schedules whose point is overlap or communication (declared ``timeline``)."""
    return names_where(lambda s: s.timeline)


def split_schedules() -> tuple[str, ...]:
    """The schedules a split varies: two device groups (async)."""
    return names_where(lambda s: s.layout == TWO_GROUPS)


def serial_baselines() -> tuple[str, ...]:
    """The GPU split's serial baselines: draft and target taking turns on all GPUs."""
    return names_where(lambda s: s.serial)


def _col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index)


# ---------------------------------------------------------------------------------------------
# GPU split


def split_label(row: pd.Series) -> str:
    spec = find(row["schedule"])
    return spec.run_label(target_gpus=row["target_gpus"]) if spec is not None else str(row["schedule"])


def gpu_split_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (pair, hardware, split): mean tokens/s over seeds; empty if no split sweep."""
    if "schedule" not in df.columns:
        return pd.DataFrame()
    split = split_schedules()
    m = df[df["schedule"].isin((*split, *serial_baselines())) & (df["backend"] == "sim")].copy()
    if m.empty or m["schedule"].isin(split).sum() == 0:
        return pd.DataFrame()
    asyn = m[m["schedule"].isin(split)]
    if asyn.groupby(["pair", "hardware"])["target_gpus"].nunique().max() < 2:
        return pd.DataFrame()
    m["split"] = [split_label(r) for _, r in m.iterrows()]
    # d of the run: its mean over the rounds where it changed (AsyncDepth), else the one it used
    m["tree_depth_used"] = _col(m, "tree_depth_mean").fillna(_col(m, "tree_depth_used"))
    agg = (m.groupby(["pair", "hardware", "split", "schedule", "target_gpus", "draft_gpus"],
                     dropna=False)
            .agg(tokens_per_s=("tokens_per_s", "mean"), speedup=("speedup", "mean"),
                 mean_accepted_len=("mean_accepted_len", "mean"), d=("tree_depth_used", "first"))
            .reset_index())
    return agg


def _split_order(splits: list[str]) -> list[str]:
    ts = sorted((s for s in splits if s.startswith("t") and s[1:].isdigit()), key=lambda s: int(s[1:]))
    return ts + [b for b in serial_baselines() if b in splits]


@section(22, "GPU split: async (SwiftSpec) vs serial baselines")
def gpu_split(ctx: ReportContext) -> str:
    agg = gpu_split_frame(ctx.df)
    if agg.empty or not ctx.draw:
        return ""
    import matplotlib.pyplot as plt

    groups = list(agg.groupby(["pair", "hardware"], sort=True))
    rows, cols = grid(len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_axis_off()
    best_rows = []
    for ax, ((pair, hw), g) in zip(axes.flat, groups):
        split = split_schedules()
        a = g[g["schedule"].isin(split)].sort_values("target_gpus")
        name = str(a["schedule"].iloc[0]) if len(a) else split[0]
        ax.plot(a["target_gpus"], a["tokens_per_s"], marker="o", color=SCHEDULE_COLORS[name], label=name)
        for b in serial_baselines():
            row = g[g["split"] == b]
            if len(row):
                color, ls = SCHEDULE_COLORS[b], "--" if find(b).tree else ":"  # type: ignore[union-attr]
                ax.axhline(float(row["tokens_per_s"].iloc[0]), color=color, linestyle=ls,
                           label=f"{b} ({int(row['target_gpus'].iloc[0])} {device_word(hw)}, serial)")
        best = g.loc[g["tokens_per_s"].idxmax()]
        x = best["target_gpus"] if best["schedule"] in split else a["target_gpus"].max() + 0.5
        ax.plot([x], [best["tokens_per_s"]], marker="*", markersize=16, color="tab:red",
                linestyle="none", label=f"best: {best['split']}")
        ax.set_xlabel(f"target {device_word(hw)} (the rest draft)")
        ax.set_ylabel("decode tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{pair}\n{hw}", fontsize=9)
        ax.set_xticks(sorted(a["target_gpus"].unique()))
        ax.legend(fontsize=7, loc="lower right")
        ref = {b: g.loc[g["split"] == b, "tokens_per_s"] for b in serial_baselines()}
        best_rows.append({
            "pair": pair, "hardware": hw, "best split": best["split"],
            f"target/draft {device_word(hw)}": f"{int(best['target_gpus'])}/{int(best['draft_gpus'])}",
            "tokens_per_s": best["tokens_per_s"], "d": best["d"],
            **{f"x vs {b}": (best["tokens_per_s"] / float(ref[b].iloc[0]) if len(ref[b]) else None)
               for b in serial_baselines()}})
    fig.tight_layout()
    savefig(fig, ctx.figure_path("gpu_split.png"))
    wide = agg.pivot_table(index=["pair", "hardware"], columns="split", values="tokens_per_s")
    wide = wide[_split_order(list(wide.columns))].reset_index()
    return ("`tN`: `async` with N target GPUs and the rest of the node for the draft; `sync` and "
            "`sync_tree` (SwiftSpec-base) run draft and target one after the other on all GPUs. "
            "The star marks the fastest placement per pair.\n\n![gpu split](gpu_split.png)\n\n"
            "Best placement per pair (`d`: tree expansions per round):\n\n"
            + markdown_table(pd.DataFrame(best_rows))
            + "\n\nDecode tokens/s of every split:\n\n" + markdown_table(wide, "{:.1f}"))


# ---------------------------------------------------------------------------------------------
# Decentralized (DSD)


@section(36, "Decentralized speculative decoding (DSD)")
def decentralized(ctx: ReportContext) -> str:
    df = ctx.df
    if "schedule" not in df.columns:
        return ""
    d = df[df["schedule"].isin(names_where(lambda s: s.pipelined))].copy()
    if d.empty:
        return ""
    for c in ("latency_ms", "tau", "comm_reduction_eq5", "key_token_fraction", "t0_ms", "t1_ms",
              "links_per_round_trip", "theory_speedup", "theory_speedup_open_chain"):
        d[c] = pd.to_numeric(_col(d, c), errors="coerce")
    parts = ["The target runs as a pipeline over `nodes` nodes; a round trip crosses "
             "`links_per_round_trip` links (activations stage to stage, then the verified tokens "
             "back to the draft's node). `comm_reduction_eq5` is DSD's eq. (5), "
             "R = C(k−1)/(k(t0+C)), with the measured mean accepted length k, the modelled target "
             "compute t0 of one decoding step, the mean one-way link time t1 and the loop's "
             "communication C = links·t1 (DSD writes (N−1)·t1 for it)."]
    if ctx.draw and len(d) > 1 and d["latency_ms"].nunique() > 1:
        import matplotlib.pyplot as plt

        sns = seaborn()
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        taus = sorted(d["tau"].dropna().unique())
        lo = d[d["tau"] == taus[0]] if taus else d
        sns.lineplot(data=lo, x="latency_ms", y="speedup", hue="nodes", marker="o",
                     palette="viridis", ax=axes[0])
        axes[0].set_title(f"speedup over ar on the same pipeline (τ={taus[0] if taus else 0:g})")
        axes[0].set_xlabel("one-way link latency (ms)")
        axes[0].set_ylabel("speedup over ar (×)")
        axes[0].set_ylim(bottom=0)
        if len(taus) > 1:
            sns.lineplot(data=d, x="tau", y="mean_accepted_len", hue="nodes", marker="o",
                         palette="viridis", ax=axes[1], errorbar=None)
            axes[1].set_title("accepted length vs τ (mean over latencies)")
            axes[1].set_xlabel("τ (relaxation of the acceptance rule)")
            axes[1].set_ylabel("mean accepted length (tokens)")
        else:
            axes[1].set_axis_off()
        sns.lineplot(data=lo, x="latency_ms", y="comm_reduction_eq5", hue="nodes", marker="o",
                     palette="viridis", ax=axes[2])
        axes[2].set_title("DSD eq. (5) communication reduction")
        axes[2].set_xlabel("one-way link latency (ms)")
        axes[2].set_ylabel("share of communication time saved")
        axes[2].set_ylim(bottom=0)
        fig.tight_layout()
        savefig(fig, ctx.figure_path("decentralized.png"))
        parts.append("![decentralized](decentralized.png)")
        if len(taus) > 1:
            # per backend: `+sweep=wan backend=real` holds measured and predicted runs of each point
            keys = (["backend"] if "backend" in d.columns and d["backend"].nunique() > 1 else []) + ["nodes"]
            point = [*keys, "latency_ms"]
            base = d[d["tau"] == taus[0]].groupby(point)["speedup"].mean()
            eff = d[d["tau"] != taus[0]].copy()
            eff["gain"] = [float(r["speedup"]) / float(base.get(tuple(r[k] for k in point), math.nan))
                           for _, r in eff.iterrows()]
            tab = eff.pivot_table(index=keys, columns="tau", values="gain").reset_index()
            tab.columns = keys + [f"τ={t:g}" for t in tab.columns[len(keys):]]
            parts.append(f"Effect of τ: speedup relative to τ={taus[0]:g}, mean over latencies "
                         "(τ > 0 trades exactness for longer accepted spans):\n\n"
                         + markdown_table(tab, "{:.3f}"))
    cols = [c for c in ("pair", "nodes", "latency_ms", "tau", "adaptive", "speedup", "tokens_per_s",
                        "mean_accepted_len", "alpha", "key_token_fraction", "t0_ms", "t1_ms",
                        "comm_reduction_eq5") if c in d.columns]
    parts.append(markdown_table(d.sort_values(["nodes", "latency_ms", "tau"])[cols]))
    th = d[d["theory_speedup"].notna()]
    if len(th):
        rows = [{"alpha": r.get("alpha_config"), "gamma": r["gamma"], "c": r.get("sim_c"),
                 "N": r["nodes"], "t0_ms": r["t0_ms"], "t1_ms": r["t1_ms"],
                 "speedup (sim)": r["speedup"], "theory (N links)": r["theory_speedup"],
                 "err %": 100 * (r["speedup"] - r["theory_speedup"]) / r["theory_speedup"],
                 "paper (N−1 links)": r["theory_speedup_open_chain"],
                 "err % vs paper": 100 * (r["speedup"] - r["theory_speedup_open_chain"])
                 / r["theory_speedup_open_chain"]} for _, r in th.iterrows()]
        parts.append("Theory check (`sim.cost_model=analytic acceptance=iid`): "
                     "E·(t0+C)/(γ·c·t0+t0+C) with E=(1−α^(γ+1))/(1−α) and C the round trip's "
                     "communication — N links in this closed loop; DSD's (N−1)·t1 shown beside.\n\n"
                     + markdown_table(pd.DataFrame(rows)))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Timeline


def draws_timeline(df: pd.DataFrame) -> bool:
    """True when this module draws the runs' Gantt charts (the plain `timeline` section skips)."""
    if "schedule" not in df.columns:
        return False
    mine = df["schedule"].isin(timeline_schedules())
    if "nodes" in df.columns:
        mine |= df["nodes"].fillna(1) > 1
    return bool(mine.any())


def _resource_order(resources: list[str]) -> list[str]:
    def key(r: str) -> tuple[int, int, str]:
        if r == "draft":
            return (0, 0, r)
        if r == "target":
            return (1, 0, r)
        if r.startswith("stage") and r[5:].isdigit():
            return (1, int(r[5:]), r)
        return (2, 0, r)  # links
    return sorted(resources, key=key)


def _pick_runs(ctx: ReportContext) -> list[tuple[Run, pd.Series]]:
    rows = [(run, row) for run, (_, row) in zip(ctx.runs, ctx.df.iterrows())]
    shown = timeline_schedules()
    mine = [(run, row) for run, row in rows if row["schedule"] in shown
            or (row.get("nodes") or 1) > 1]
    if len(mine) <= 2:
        return mine
    groups: dict[tuple[str, str], list[tuple[Run, pd.Series]]] = {}
    for run, row in mine:
        groups.setdefault((row["pair"], row["schedule"]), []).append((run, row))
    out = []
    for members in groups.values():  # the fastest run per (pair, schedule) ...
        members.sort(key=lambda m: -(m[1]["tokens_per_s"] or 0))
        out.append(members[0])
    if len(groups) == 1 and len(mine) > 1:  # ... and the slowest too when that is all there is
        out.append(members[-1])
    return out[:MAX_GANTT_RUNS]


def _busy_share(tl: pd.DataFrame, decode_s: float) -> dict[str, float]:
    busy = (tl["end_s"] - tl["start_s"]).groupby(tl["resource"]).sum()
    return {r: float(v) / decode_s for r, v in busy.items()} if decode_s > 0 else {}


@section(55, "Timeline (Gantt)")
def gantt(ctx: ReportContext) -> str:
    if not ctx.draw or not draws_timeline(ctx.df):
        return ""
    import matplotlib.pyplot as plt

    picked = []
    for run, row in _pick_runs(ctx):
        tl, rounds = run.frame("timeline"), run.frame("rounds")
        if tl.empty or rounds.empty:
            continue
        rid = int(rounds["request_id"].min())
        rr = rounds[rounds["request_id"] == rid].sort_values("round")
        t0 = float(rr["start_s"].iloc[0])
        t1 = float(rr["end_s"].iloc[min(GANTT_ROUNDS, len(rr)) - 1])
        req = tl[(tl["request_id"] == rid) & (tl["kind"] != "prefill")]
        decode_s = float(rr["end_s"].iloc[-1]) - t0
        share = _busy_share(req[(req["start_s"] >= t0) & (req["end_s"] <= rr["end_s"].iloc[-1] + 1e-12)],
                            decode_s)
        win = req[(req["end_s"] > t0) & (req["start_s"] < t1)]
        if not win.empty:
            picked.append((row, win, t0, t1, share))
    if not picked:
        return ""
    kinds = sorted({k for _, w, *_ in picked for k in w["kind"].unique()})
    colors = colors_for(kinds)
    heights = [max(2.3, 0.45 * w["resource"].nunique() + 1.2) for _, w, *_ in picked]
    fig, axes = plt.subplots(len(picked), 1, figsize=(9, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    tables = []
    for ax, (row, win, t0, t1, share) in zip(axes[:, 0], picked):
        resources = _resource_order(list(win["resource"].unique()))
        for i, res in enumerate(resources):
            for kind, g in win[win["resource"] == res].groupby("kind"):
                ax.broken_barh(list(zip((g["start_s"] - t0) * 1e3, (g["end_s"] - g["start_s"]) * 1e3)),
                               (i - 0.4, 0.8), facecolors=colors[kind], label=kind,
                               edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(resources)), resources, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, (t1 - t0) * 1e3)
        label = (f"{row['schedule']} · {row['pair']} · target {row['target_gpus']} / draft "
                 f"{row['draft_gpus']} {device_word(row['hardware'])}")
        if (row.get("nodes") or 1) > 1:
            label += f" · {row['nodes']} nodes, {row.get('latency_ms', '?')} ms links"
        ax.set_title(f"{label} — first {GANTT_ROUNDS} rounds of request 0", fontsize=9)
        legend_outside(ax)  # beside the chart: inside, it covered the last rounds' bars
        tables.append({"run": label, **{f"busy {r}": share.get(r) for r in _resource_order(list(share))
                                        if not r.startswith("link")},
                       "busy links (sum)": sum(v for r, v in share.items() if r.startswith("link")) or None})
    axes[-1, 0].set_xlabel("ms since the first decode round")
    fig.tight_layout()
    savefig(fig, ctx.figure_path("gantt.png"))
    note = ("\n\nOne chart per run; with more than two runs, the fastest per pair and schedule "
            f"(and the slowest when there is one such group), at most {MAX_GANTT_RUNS}."
            ) if len(ctx.runs) > 1 else ""
    return ("Rows are GPU groups (draft, target, pipeline stages) and links; in `async` the draft's "
            "tree expansions overlap the target's verification. Busy share = time a resource "
            "works / decode time of request 0." + note + "\n\n![gantt](gantt.png)\n\n"
            + markdown_table(pd.DataFrame(tables), "{:.2f}"))
