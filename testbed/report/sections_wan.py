"""Report section "DSD over WAN: measured and predicted" (`+sweep=wan backend=real`).

For every decentralized grid point (nodes, one-way link latency, τ) measured for real, beside it
the simulator's prediction of the same point (the `predict` role: latency profile + the
measured run's acceptance), then DSD's closed forms evaluated with what was *measured*:

- eq. 9, speedup = E·(t0 + C) / (γ·c·t0 + t0 + C) with C = links·t1, from the run's measured
  α (Leviathan's eq. 1 inverted from tokens per round), c (draft seconds per round / γ·t0),
  t0 (one 1-token traversal of all stages, on the `ar` baseline) and t1 (mean one-way link time):
  drawn as a curve over the latency axis (t1 = the configured latency) per node count;
- eq. 5's communication reduction with the measured tokens per round.

Quality of τ > 0 beside its speed: the target's NLL per generated token (τ against its `ar`
baseline; HumanEval's pass@1 beside it when the runs executed the tests, workload.exec_tests),
and, paired with the τ = 0 run of the same point (same seed, coupled random
streams), the share of outputs identical to it and the mean first-divergence position
(testbed.metrics.divergence).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from testbed.metrics import divergence
from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.schedule_kinds import pipelined
from testbed.report.style import savefig
from testbed.theory import dsd_speedup

POINT = ("pair", "nodes", "latency_ms", "tau", "temperature")


def _outputs(run_dir: str) -> list[list[int]] | None:
    path = Path(run_dir) / "requests.parquet"
    if not path.exists():
        return None
    req = pd.read_parquet(path).sort_values("request_id")
    return [list(map(int, o)) for o in req["output_ids"]]


def _frame(df: pd.DataFrame) -> pd.DataFrame:
    d = df[df["schedule"].isin(pipelined())].copy() if "schedule" in df.columns else pd.DataFrame()
    if d.empty or "latency_ms" not in d.columns:
        return pd.DataFrame()
    for c in ("latency_ms", "tau", "nodes", "temperature"):
        d[c] = pd.to_numeric(d[c], errors="coerce").fillna(0.0)
    return d


@section(37, "DSD over WAN: measured and predicted")
def wan(ctx: ReportContext) -> str:
    d = _frame(ctx.df)
    if d.empty or "real" not in set(d["backend"]):
        return ""
    real = d[d["backend"] == "real"].set_index(list(POINT))
    sim = d[d["backend"] == "sim"].groupby(list(POINT))[["tokens_per_s", "speedup"]].mean()
    rows = []
    for key, r in real.iterrows():
        point = dict(zip(POINT, key))
        pred = sim.loc[key] if key in sim.index else None
        row = {k: point[k] for k in ("nodes", "latency_ms", "tau")}
        row["tok/s measured"] = r.get("tokens_per_s")
        row["tok/s predicted"] = None if pred is None else pred["tokens_per_s"]
        row["error %"] = (None if pred is None or not r.get("tokens_per_s") else
                          100.0 * (pred["tokens_per_s"] - r["tokens_per_s"]) / r["tokens_per_s"])
        row["speedup measured"] = r.get("speedup")
        row["speedup predicted"] = None if pred is None else pred["speedup"]
        row["eq. 9 (measured α,c,t0,t1)"] = r.get("theory_speedup")
        row["α"] = r.get("alpha_measured")
        row["t0 ms"] = r.get("t0_ms")
        row["t1 ms"] = r.get("t1_ms")
        row["window ms"] = r.get("t_window_ms")
        row["eq. 5 R_comm"] = r.get("comm_reduction_eq5")
        row["NLL/token"] = r.get("target_nll_per_token")
        row["NLL/token ar"] = r.get("baseline_nll_per_token")
        if "pass_at_1" in real.columns:  # HumanEval with workload.exec_tests=true
            row["pass@1"] = r.get("pass_at_1")
            row["pass@1 ar"] = r.get("pass_at_1_baseline")
        row.update(_against_lossless(real, key, r))
        rows.append(row)
    tab = pd.DataFrame(rows).sort_values(["nodes", "latency_ms", "tau"])
    errs = tab["error %"].dropna().abs()
    parts = ["Real runs (one stage process per emulated node) beside the simulator's prediction of "
             "the same grid point; eq. 9 and eq. 5 evaluated with the quantities the real run "
             "measured. `identical` / `first divergence`: outputs against the τ = 0 run of the same "
             "point (same seed: the random streams are coupled until the rule first decides "
             "differently); at temperature 0 the summary's own fields compare with the `ar` baseline."]
    if len(errs):
        parts.append(f"Median |error| of tokens/s: **{errs.median():.1f} %** (worst {errs.max():.1f} %) "
                     f"over {len(errs)} points.")
    if ctx.draw:
        _figure(ctx, tab, real)
        parts.append("![wan](wan.png)")
    parts.append(markdown_table(tab))
    return "\n\n".join(parts)


def _against_lossless(real: pd.DataFrame, key: tuple, r: pd.Series) -> dict[str, float | None]:
    point = dict(zip(POINT, key))
    if float(point["tau"]) == 0.0:
        return {"identical": None, "first divergence": None}
    ref_key = tuple(0.0 if k == "tau" else point[k] for k in POINT)
    if ref_key not in real.index:
        return {"identical": None, "first divergence": None}
    ref = real.loc[ref_key]
    ref = ref.iloc[0] if isinstance(ref, pd.DataFrame) else ref
    mine, theirs = _outputs(r["run_dir"]), _outputs(ref["run_dir"])
    if mine is None or theirs is None:
        return {"identical": None, "first divergence": None}
    dv = divergence(mine, theirs)
    return {"identical": dv["identical_share"], "first divergence": dv["first_divergence_mean"]}


def _figure(ctx: ReportContext, tab: pd.DataFrame, real: pd.DataFrame) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("viridis")
    nodes = sorted(tab["nodes"].unique())
    lat = sorted(tab["latency_ms"].unique())
    for i, n in enumerate(nodes):
        color = colors(i / max(1, len(nodes) - 1))
        t = tab[(tab["nodes"] == n) & (tab["tau"] == 0.0)].sort_values("latency_ms")
        if t.empty:
            continue
        ax.plot(t["latency_ms"], t["speedup measured"], "o-", color=color, label=f"N={int(n)} measured")
        ax.plot(t["latency_ms"], t["speedup predicted"], "s--", color=color, alpha=0.7,
                label=f"N={int(n)} predicted")
        r = real.reset_index()
        r = r[(r["nodes"] == n) & (r["tau"] == 0.0)]
        a, c, t0 = (pd.to_numeric(r[k], errors="coerce").mean() for k in ("alpha_measured", "c_measured", "t0_ms"))
        gamma = int(pd.to_numeric(r["gamma"], errors="coerce").iloc[0])
        if all(math.isfinite(x) for x in (a, c, t0)):
            xs = [lat[0] + (lat[-1] - lat[0]) * j / 40 for j in range(41)]
            ax.plot(xs, [dsd_speedup(a, gamma, c=c, t0=t0, t1=x, nodes=int(n) + 1) for x in xs], ":", color=color,
                    label=f"N={int(n)} eq. 9 (α={a:.2f}, t0={t0:.0f} ms)")
    ax.set_xlabel("one-way link latency (ms)")
    ax.set_ylabel("speedup over ar on the same pipeline")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("DSD on real stage processes over emulated WAN (τ = 0)")
    fig.tight_layout()
    savefig(fig, ctx.figure_path("wan.png"))
