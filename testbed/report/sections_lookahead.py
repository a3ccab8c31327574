"""Report section "Lookahead policies" (`+sweep=lookahead`): DISCO's Table 1 layout, sim and
real side by side — per (pair, workload, temperature) and policy: latency per token, speedup
over `ar`, target and draft forwards per generated token. ``static-opt`` is the best static γ
of each backend (by tokens/s), chosen per group, as the paper's baseline. Real runs on the
splits that feed traces (calibrate role) are inputs, not rows. Writes ``lookahead.csv``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.schedule_kinds import chains
from testbed.results import run_split
from testbed.workloads import TRACE_SPLITS

GROUP = ("pair", "workload", "temperature")
ORDER = ("static-opt", "heuristic", "confidence", "disco", "oracle")


def lookahead_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (group, policy label, backend): the Table 1 metrics."""
    need = {"lookahead", "tpot_ms", "verifications", "generated_tokens", "backend", *GROUP}
    if not need <= set(df.columns):
        return pd.DataFrame()
    d = df[df["schedule"].isin(chains())].copy()  # per-token policies run in the chain
    if "run_dir" in d.columns:
        split = [run_split(Path(r["run_dir"]), r.to_dict()) for _, r in d.iterrows()]
        d = d[~((d["backend"] == "real") & pd.Series(split, index=d.index).isin(TRACE_SPLITS))]
    if d.empty or d["lookahead"].nunique() < 2:
        return pd.DataFrame()
    gen = d["generated_tokens"].astype(float)
    d["target_fw_per_token"] = d["verifications"].astype(float) / gen
    fw = d["draft_forwards"] if "draft_forwards" in d.columns else pd.Series(float("nan"), index=d.index)
    d["draft_fw_per_token"] = fw.astype(float) / gen
    d["policy"] = [f"static γ={int(g)}" if p == "static" else p for p, g in zip(d["lookahead"], d["gamma"])]
    cols = [*GROUP, "backend", "policy", "gamma", "tokens_per_s", "tpot_ms", "speedup",
            "target_fw_per_token", "draft_fw_per_token"]
    d = d[cols].groupby([*GROUP, "backend", "policy"], as_index=False, dropna=False).mean(numeric_only=True)
    rows = [d]
    static = d[d["policy"].str.startswith("static")]
    if not static.empty:
        best = static.loc[static.groupby([*GROUP, "backend"], dropna=False)["tokens_per_s"].idxmax()].copy()
        best["policy"] = "static-opt"
        rows.append(best)
    return pd.concat(rows, ignore_index=True)


def table1(frame: pd.DataFrame) -> pd.DataFrame:
    """Wide: rows (group, policy), columns metric × backend; static-opt shows its γ."""
    wide = frame.pivot_table(index=[*GROUP, "policy"], columns="backend",
                             values=["tpot_ms", "speedup", "target_fw_per_token", "draft_fw_per_token", "gamma"],
                             aggfunc="first")
    metrics = ("tpot_ms", "speedup", "target_fw_per_token", "draft_fw_per_token", "gamma")
    wide = wide[[c for m in metrics for b in ("sim", "real") for c in [(m, b)] if c in wide.columns]]
    wide.columns = [f"{m} ({b})" for m, b in wide.columns]
    wide = wide.reset_index()
    rank = {p: i for i, p in enumerate(ORDER)}
    wide["_o"] = [rank.get(p, -1) for p in wide["policy"]]
    wide["_g"] = [int(p.split("=")[1]) if p.startswith("static γ=") else 0 for p in wide["policy"]]
    return wide.sort_values([*GROUP, "_o", "_g"]).drop(columns=["_o", "_g"]).reset_index(drop=True)


@section(55, "Lookahead policies (DISCO Table 1)")
def lookahead_table(ctx: ReportContext) -> str:
    frame = lookahead_frame(ctx.df)
    if frame.empty:
        return ""
    wide = table1(frame)
    wide.to_csv(ctx.out_dir / "lookahead.csv", index=False)
    lines = ["Latency per token (ms), speedup over `ar`, target and draft forwards per generated token; "
             "`static-opt`: each backend's best static γ (its `gamma` column). Sim: the prediction "
             "(acceptance replayed from static traces, profile cost model). Also in lookahead.csv.\n"]
    gains = []
    for key, g in frame.groupby(list(GROUP), dropna=False):
        for backend, b in g.groupby("backend"):
            opt = b[b["policy"] == "static-opt"]["tokens_per_s"]
            for pol in ("disco", "confidence", "heuristic", "oracle"):
                x = b[b["policy"] == pol]["tokens_per_s"]
                if len(opt) and len(x):
                    gains.append({"pair": key[0], "workload": key[1], "temperature": key[2], "backend": backend,
                                  "policy": pol, "vs_static_opt_pct": 100 * (float(x.iloc[0]) / float(opt.iloc[0]) - 1)})
    lines.append(markdown_table(wide))
    if gains:
        lines.append("\nTokens/s against static-opt (%):\n")
        lines.append(markdown_table(pd.DataFrame(gains), floatfmt="{:+.1f}"))
    return "\n".join(lines)
