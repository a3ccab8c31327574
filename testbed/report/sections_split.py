"""Report section for `+sweep=gpu_split backend=real`: the GPU split of this machine, predicted
(backend=sim) beside measured (backend=real).

The runs are paired on the experiment key and prompt split exactly as the validation section
pairs them (sections_validate.validation_frame). Per (pair, hardware, workload, temperature):
tokens/s of every split (`tN`: async with N target devices, the rest draft; `sync`, `sync_tree`,
`ar` on all devices), predicted and measured side by side, the error per point, the compression
ratio's error (tokens per verification), the best split of each backend marked, and whether the
simulator ranks the splits in the measured order.
"""

from __future__ import annotations

import pandas as pd

from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.sections_validate import validation_frame
from testbed.report.style import MEASURED_COLOR, PREDICTED_COLOR, grid, legend_outside, savefig
from testbed.schedules import BASELINE, TWO_GROUPS, find, names_where

GROUP = ["pair", "hardware", "workload", "temperature"]


def split_schedules() -> tuple[str, ...]:
    """The schedules of a split grid: the two-group ones (one point per split), then the serial
    ones and the `ar` baseline (on all devices)."""
    return (*names_where(lambda s: s.layout == TWO_GROUPS), *names_where(lambda s: s.serial), BASELINE)


def split_name(schedule: str, target_gpus: int) -> str:
    """``tN`` for a two-group schedule with N target devices (its declared label), else its name."""
    spec = find(schedule)
    return spec.run_label(target_gpus=target_gpus) if spec is not None else schedule


def split_order(split: str) -> tuple[int, int]:
    """tN by N, then the serial baselines and ar."""
    if split.startswith("t") and split[1:].isdigit():
        return 0, int(split[1:])
    order = split_schedules()
    return 1, order.index(split) if split in order else 99


def split_pairs(val: pd.DataFrame) -> pd.DataFrame:
    """One row per (group, split): predicted and measured tokens/s and tokens per verification,
    errors, and the best split of each backend marked; empty unless every paired split schedule
    is among ``split_schedules()`` and more than one split was paired."""
    if val.empty:
        return pd.DataFrame()
    v = val[val["schedule"].isin(split_schedules())
            & val["metric"].isin(("tokens_per_s", "mean_accepted_len"))].copy()
    if v.empty:
        return pd.DataFrame()
    v["split"] = [split_name(s, t) for s, t in zip(v["schedule"], v["target_gpus"])]
    wide = v.pivot_table(index=[*GROUP, "split", "target_gpus", "draft_gpus"], columns="metric",
                         values=["predicted", "measured"], aggfunc="mean")
    wide.columns = [f"{m}_{b}" for b, m in wide.columns]
    out = wide.reset_index().rename(columns={
        "tokens_per_s_predicted": "predicted_tokens_per_s", "tokens_per_s_measured": "measured_tokens_per_s",
        "mean_accepted_len_predicted": "predicted_tokens_per_verification",
        "mean_accepted_len_measured": "measured_tokens_per_verification"})
    if out.groupby(GROUP)["split"].nunique().max() < 2:
        return pd.DataFrame()
    out["tokens_per_s_error_pct"] = 100.0 * (out["predicted_tokens_per_s"] / out["measured_tokens_per_s"] - 1.0)
    if "predicted_tokens_per_verification" in out:
        out["tokens_per_verification_error_pct"] = 100.0 * (
            out["predicted_tokens_per_verification"] / out["measured_tokens_per_verification"] - 1.0)
    out = out.sort_values([*GROUP, "split"], key=lambda c: c.map(split_order) if c.name == "split" else c)
    out = out.reset_index(drop=True)
    for who in ("predicted", "measured"):
        col = f"{who}_tokens_per_s"
        best = out.groupby(GROUP)[col].transform("max")
        out[f"best_{who}"] = out[col].eq(best)
    return out


def same_ranking(g: pd.DataFrame) -> bool:
    """Whether the simulator orders the splits as the measurement does (fastest first)."""
    pred = list(g.sort_values("predicted_tokens_per_s", ascending=False)["split"])
    meas = list(g.sort_values("measured_tokens_per_s", ascending=False)["split"])
    return pred == meas


def _plot(pairs: pd.DataFrame, path: str) -> None:
    import matplotlib.pyplot as plt

    groups = list(pairs.groupby(GROUP, sort=True))
    rows, cols = grid(len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_axis_off()
    for ax, (key, g) in zip(axes.flat, groups):
        g = g.reset_index(drop=True)
        x = range(len(g))
        ax.bar([i - 0.2 for i in x], g["predicted_tokens_per_s"], width=0.4, label="predicted (sim)",
               color=PREDICTED_COLOR, alpha=0.6)
        ax.bar([i + 0.2 for i in x], g["measured_tokens_per_s"], width=0.4, label="measured (real)",
               color=MEASURED_COLOR)
        for who, dx in (("predicted", -0.2), ("measured", 0.2)):
            best = g.index[g[f"best_{who}"]][0]
            ax.plot([best + dx], [g.loc[best, f"{who}_tokens_per_s"] * 1.04], marker="*", markersize=13,
                    color="tab:red", linestyle="none")
        ax.set_xticks(list(x))
        ax.set_xticklabels(g["split"])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(_group_label(key), fontsize=8)
        legend_outside(ax)  # beside the bars: inside, it covered the last splits' bars
    fig.tight_layout()
    savefig(fig, path)


def _group_label(key: tuple) -> str:
    """pair · hardware · workload · T=temperature (a bare 0.0 reads as nothing)."""
    *names, temperature = key
    return " · ".join([*map(str, names), f"T={float(temperature):g}"])


@section(23, "GPU split on this machine: predicted vs measured")
def gpu_split_measured(ctx: ReportContext) -> str:
    pairs = split_pairs(validation_frame(ctx.runs))
    if pairs.empty:
        return ""
    pairs.to_csv(ctx.out_dir / "gpu_split_validation.csv", index=False)
    lines = ["`tN`: `async` with N target devices and the rest for the draft; `sync`, `sync_tree` "
             "and `ar` on all devices. Predicted = `backend=sim` (profile cost model), measured = "
             "`backend=real`; error = 100·(predicted − measured)/measured; ★ = the best split of "
             "each (written to `gpu_split_validation.csv`).\n"]
    if ctx.draw:
        _plot(pairs, str(ctx.figure_path("gpu_split_measured.png")))
        lines.append("![gpu split measured](gpu_split_measured.png)\n")
    for key, g in pairs.groupby(GROUP, sort=True):
        table = pd.DataFrame({
            "split": g["split"],
            "target/draft": [f"{int(t)}/{int(d)}" for t, d in zip(g["target_gpus"], g["draft_gpus"])],
            "predicted tok/s": [f"{v:.2f}" + (" ★" if b else "")
                                for v, b in zip(g["predicted_tokens_per_s"], g["best_predicted"])],
            "measured tok/s": [f"{v:.2f}" + (" ★" if b else "")
                               for v, b in zip(g["measured_tokens_per_s"], g["best_measured"])],
            "tok/s error %": [f"{v:+.1f}" for v in g["tokens_per_s_error_pct"]],
            "tokens/verification error %": [f"{v:+.1f}" if pd.notna(v) else "—"
                                            for v in g.get("tokens_per_verification_error_pct",
                                                           pd.Series([None] * len(g)))],
        })
        err = g["tokens_per_s_error_pct"].abs()
        lines.append(f"**{_group_label(key)}** — median |error| {err.median():.1f} %, "
                     f"worst {err.max():.1f} %; the simulator ranks the splits "
                     f"{'in the measured order' if same_ranking(g) else 'NOT in the measured order'}.\n")
        lines.append(markdown_table(table) + "\n")
    return "\n".join(lines)
