"""Report section "Validation": the simulator's predictions against real measurements.

Joins `backend=sim` and `backend=real` runs on the experiment key (every key field but
`backend`, plus the prompt split: a `test` (or `holdout`) prediction is compared with the
measurement on the same split; real runs on the trace-source splits `trace`/`calibrate` fed the
prediction and are not compared) and,
per metric, reports ``error_pct = 100 · (predicted − measured) / measured`` (docs/calibration.md).
Writes ``validation.csv`` (experiment key, metric, predicted, measured, error_pct), draws a
parity plot (predicted against measured, y = x dashed) and states the headline: median and
worst |error| of tokens/s against the fidelity target (≤ 5 % median, ≤ 15 % worst).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from testbed import backends
from testbed.report.context import ReportContext, markdown_table, section
from testbed.report.schedule_kinds import chains, pipelined, serial
from testbed.report.style import seaborn
from testbed.report.validate_intervals import add_interval_columns, inside_share
from testbed.report.validate_own_acceptance import (
    own_acceptance_frame,
    own_acceptance_lines,
    resimulated,
)
from testbed.report.validate_runs import JOIN, family, measured_with_source, run_split
from testbed.report.validate_sampling import sizing_lines
from testbed.results import Run
from testbed.workloads import TRACE_SPLITS

# under load (testbed.metrics.load_metrics) also the system's throughput and the P50/P90 TPOT
LOAD_METRICS = ("throughput_tok_s", "tpot_ms_p50", "tpot_ms_p90")
METRICS = ("tokens_per_s", "tpot_ms", "mean_accepted_len", "ar_tokens_per_s", "speedup", *LOAD_METRICS)
PARITY_METRICS = ("tokens_per_s", "tpot_ms", "mean_accepted_len", *LOAD_METRICS)
# validation.csv's rows: a decentralized point is also its links and τ (`+sweep=wan`), a point
# under load its arrivals, "-" otherwise
VJOIN = (*JOIN, "dsd_point", "load_point")
TARGET_MEDIAN, TARGET_WORST, TARGET_P90 = 5.0, 15.0, 10.0
# under load: median |error| of throughput and P50 TPOT, and of P90 TPOT
TARGET_LOAD, TARGET_LOAD_P90_TPOT = 5.0, 10.0


def load_point(summary: dict) -> str:
    arrival = summary.get("arrival")
    if not arrival:
        return "-"
    if arrival == "closed":
        return f"{summary.get('concurrency')} clients"
    return f"poisson {summary.get('rate')}/s" if arrival == "poisson" else "trace"


def dsd_point(summary: dict) -> str:
    if summary.get("schedule") not in pipelined():
        return "-"
    return f"{float(summary.get('latency_ms') or 0):g} ms, τ={float(summary.get('tau') or 0):g}"


def validation_frame(runs: list[Run]) -> pd.DataFrame:
    """Long table: one row per (experiment key, metric) present on both backends."""
    rows = []
    for run in runs:
        s = run.summary
        if s.get("backend") not in ("sim", "real"):
            continue
        split = run_split(run)
        if s["backend"] == "real" and split in TRACE_SPLITS:
            continue  # the prediction's inputs, not something to predict
        rows.append({**{k: s.get(k) for k in JOIN if k != "split"}, "split": split,
                     "family": family(s), "dsd_point": dsd_point(s), "load_point": load_point(s),
                     "backend": s["backend"],
                     **{m: s.get(m) for m in METRICS}})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    # a key field an older summary lacks (e.g. lookahead) joins as "-": pivot_table drops NaN keys
    df[list(VJOIN)] = df[list(VJOIN)].astype(object).where(df[list(VJOIN)].notna(), "-")
    if set(df["backend"]) != {"sim", "real"}:
        return pd.DataFrame()
    df["temperature"] = df["temperature"].astype(float)
    long = df.melt(id_vars=[*VJOIN, "family", "backend"], value_vars=list(METRICS), var_name="metric")
    long = long.dropna(subset=["value"])
    long["value"] = long["value"].astype(float)
    wide = long.pivot_table(index=[*VJOIN, "family", "metric"], columns="backend", values="value",
                            aggfunc="mean")
    if "sim" not in wide or "real" not in wide:
        return pd.DataFrame()
    wide = wide.dropna(subset=["sim", "real"]).reset_index()
    out = wide.rename(columns={"sim": "predicted", "real": "measured"})
    out = out[[*VJOIN, "family", "metric", "predicted", "measured"]]
    out["error_pct"] = 100.0 * (out["predicted"] - out["measured"]) / out["measured"]
    out = add_interval_columns(out, runs, join=JOIN, metrics=METRICS, split_of=run_split)
    order = {m: i for i, m in enumerate(METRICS)}
    out = out.sort_values(["metric", *VJOIN], key=lambda c: c.map(order) if c.name == "metric" else c)
    return out.reset_index(drop=True)


def replay_measured(run: Run) -> dict | None:
    """The latency model alone: the measured run's *own* recorded rounds timed by the profile,
    rescaled to the round times of the calibrate runs beside it. Its error isolates the
    latency model from the acceptance transfer between prompt splits. None if not possible."""
    import copy

    import pandas as pd
    import yaml

    from testbed.compose import to_experiment
    from testbed.config import ConfigError

    exp_file = run.path / "experiment.yaml"
    if not exp_file.exists() or run.summary.get("schedule") not in chains():
        return None
    try:
        replay_seconds = backends.get("sim").replay_seconds
        assert replay_seconds is not None
        exp = copy.deepcopy(to_experiment(yaml.safe_load(exp_file.read_text())))
        exp.pair.name = run.summary.get("pair", exp.pair.name)
        exp.backend, exp.sim.cost_model, exp.sim.profile_rescale = "sim", "profile", True
        exp.acceptance.oracle, exp.acceptance.trace_path = "trace", str(run.path.parent)
        seconds = replay_seconds(exp, run.path)
    except (ConfigError, FileNotFoundError, ValueError, KeyError):
        return None
    req = pd.read_parquet(run.path / "requests.parquet", columns=["request_id", "generated"])
    rates = [g / seconds[r] for r, g in zip(req["request_id"], req["generated"]) if seconds.get(r)]
    return {"tokens_per_s": sum(rates) / len(rates)} if rates else None


def timing_only_frame(runs: list[Run], val: pd.DataFrame) -> pd.DataFrame:
    """tokens/s of every measured real run against the sim replaying that run's acceptance."""
    measured = {tuple(r[k] for k in JOIN) for _, r in val.iterrows()}
    rows = []
    for run in runs:
        s = run.summary
        if s.get("backend") != "real" or run_split(run) in TRACE_SPLITS:
            continue
        key = tuple(s.get(k) if k != "split" else run_split(run) for k in JOIN)
        key = tuple(float(v) if k == "temperature" else v for k, v in zip(JOIN, key))
        if key not in measured:
            continue
        pred = replay_measured(run)
        if pred is None or not pred.get("tokens_per_s") or not s.get("tokens_per_s"):
            continue
        rows.append({**dict(zip(JOIN, key)), "predicted": pred["tokens_per_s"], "measured": s["tokens_per_s"],
                     "error_pct": 100.0 * (pred["tokens_per_s"] - s["tokens_per_s"]) / s["tokens_per_s"]})
    return pd.DataFrame(rows)


def rescaled_prediction(run: Run) -> float | None:
    """tokens/s of the sim run ``run`` predicted again with the profile's level rescaled to the
    round times of the trace-source real run of the *same configuration* (sim.profile_rescale):
    the prediction validate made before stop 11. It leans on a real run of the configuration it
    predicts, so the goals apply to the standalone prediction; this shows what that costs."""
    def edit(exp) -> bool:  # type: ignore[no-untyped-def]
        if exp.sim.cost_model != "profile" or exp.acceptance.oracle != "trace" or exp.sim.profile_rescale:
            return False
        exp.sim.profile_rescale, exp.sim.profile_drift = True, "none"
        return True

    if run.summary.get("schedule") not in chains():
        return None
    summary = resimulated(run, edit)
    return summary.get("tokens_per_s") if summary else None


def rescaled_frame(runs: list[Run], val: pd.DataFrame) -> pd.DataFrame:
    """The standalone predictions' tokens/s error beside the rescaled predictions' (see above)."""
    tps = val[val["metric"] == "tokens_per_s"]
    measured = {tuple(r[k] for k in JOIN): r["measured"] for _, r in tps.iterrows()}
    rows = []
    for run in runs:
        s = run.summary
        if s.get("backend") != "sim":
            continue
        key = tuple(float(s.get(k)) if k == "temperature" else
                    (run_split(run) if k == "split" else s.get(k)) for k in JOIN)
        got = measured.get(key)
        if not got or not s.get("tokens_per_s"):
            continue
        pred = rescaled_prediction(run)
        if pred is None:
            continue
        rows.append({**dict(zip(JOIN, key)), "standalone": s["tokens_per_s"], "rescaled": pred,
                     "measured": got,
                     "standalone_error_pct": 100.0 * (s["tokens_per_s"] - got) / got,
                     "rescaled_error_pct": 100.0 * (pred - got) / got,
                     "drift_factor": s.get("profile_drift_factor")})
    return pd.DataFrame(rows)


def sibling_replay(measured: Run, source: Run) -> float | None:
    """tokens/s of `measured` if each of its rounds had taken the time that rounds with as many
    verified tokens took in `source` (the same configuration on the trace prompts, a minute
    earlier): the median round time per verified-token count, scaled by source's ratio of
    decode time to those medians (inter-round overhead). A real run predicting a real run."""
    cols = ["request_id", "start_s", "end_s", "verified_tokens"]
    try:
        src = pd.read_parquet(source.path / "rounds.parquet", columns=cols)
        mes = pd.read_parquet(measured.path / "rounds.parquet", columns=cols)
        src_req = pd.read_parquet(source.path / "requests.parquet", columns=["decode_s"])
        mes_req = pd.read_parquet(measured.path / "requests.parquet", columns=["request_id", "generated"])
    except (FileNotFoundError, KeyError, ValueError):
        return None
    src = src.assign(dur=src["end_s"] - src["start_s"])
    med = src.groupby("verified_tokens")["dur"].median()
    if med.empty or (med <= 0).all():
        return None
    ks = med.index.to_numpy()

    def at(k: int) -> float:  # the nearest verified-token count the source run has
        return float(med.iloc[int(abs(ks - k).argmin())])

    modelled = float(sum(at(k) for k in src["verified_tokens"]))
    scale = float(src_req["decode_s"].sum()) / modelled if modelled > 0 else 1.0
    seconds = mes.groupby("request_id")["verified_tokens"].apply(lambda v: scale * sum(at(k) for k in v))
    rates = [g / seconds[r] for r, g in zip(mes_req["request_id"], mes_req["generated"])
             if seconds.get(r, 0.0) > 0]
    return sum(rates) / len(rates) if rates else None


def sibling_replay_frame(runs: list[Run], val: pd.DataFrame) -> pd.DataFrame:
    """Every measured real run against its trace-source real run replayed on its rounds: the
    run-to-run timing noise of the machine, a floor for any latency model's tokens/s error."""
    rows = []
    for run, src, key in measured_with_source(runs, val, serial()):
        if not run.summary.get("tokens_per_s"):
            continue
        pred = sibling_replay(run, src)
        if pred is None:
            continue
        got = float(run.summary["tokens_per_s"])
        rows.append({**key, "predicted": pred, "measured": got, "error_pct": 100.0 * (pred - got) / got})
    return pd.DataFrame(rows)


def error_stats(val: pd.DataFrame, by: tuple[str, ...] = ("metric",)) -> pd.DataFrame:
    """Per metric (and family): experiments, median, P90 and worst |error|, mean signed error (%),
    and where intervals were measured the share of predictions inside them (%)."""
    g = val.assign(abs_err=val["error_pct"].abs()).groupby(list(by), sort=False)
    aggs = {"experiments": ("error_pct", "size"), "median_abs_error_pct": ("abs_err", "median"),
            "p90_abs_error_pct": ("abs_err", lambda x: float(x.quantile(0.9))),
            "worst_abs_error_pct": ("abs_err", "max"), "mean_error_pct": ("error_pct", "mean")}
    if "inside" in val and val["inside"].notna().any():
        aggs["inside_pct"] = ("inside", lambda x: 100 * float(x.mean()))  # (NaN: no interval)
    return g.agg(**aggs).reset_index()


def parity_plot(val: pd.DataFrame, path: str) -> None:
    sns = seaborn()
    metrics = [m for m in PARITY_METRICS if m in set(val["metric"])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.4 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        m = val[val["metric"] == metric]
        sns.scatterplot(data=m, x="measured", y="predicted", hue="pair", style="temperature", ax=ax,
                        legend=metric == metrics[-1])
        lo = float(min(m["measured"].min(), m["predicted"].min()))
        hi = float(max(m["measured"].max(), m["predicted"].max()))
        pad = 0.05 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", linewidth=1, label="_y=x")
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(metric)
        ax.set_xlabel("measured (backend=real)")
        ax.set_ylabel("predicted (backend=sim)")
    if metrics and axes[0][len(metrics) - 1].get_legend() is not None:
        sns.move_legend(axes[0][len(metrics) - 1], "upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


@section(12, "Validation: simulator vs real")
def validation(ctx: ReportContext) -> str:
    val = validation_frame(ctx.runs)
    if val.empty:
        return ""
    val.to_csv(ctx.out_dir / "validation.csv", index=False)
    stats = error_stats(val)
    parity_plot(val, str(ctx.figure_path("parity.png")))
    tps = stats[stats["metric"] == "tokens_per_s"]
    lines = []
    if len(tps):
        med, worst = float(tps["median_abs_error_pct"].iloc[0]), float(tps["worst_abs_error_pct"].iloc[0])
        ok = med <= TARGET_MEDIAN and worst <= TARGET_WORST
        lines.append(f"**tokens/s: median |error| {med:.1f} %, worst |error| {worst:.1f} %** over "
                     f"{int(tps['experiments'].iloc[0])} experiments — target ≤ {TARGET_MEDIAN:g} % / "
                     f"≤ {TARGET_WORST:g} %: {'met' if ok else 'NOT met'}.\n")
    load = error_stats(val[val["metric"].isin(LOAD_METRICS)])
    if len(load):
        med = dict(zip(load["metric"], load["median_abs_error_pct"]))
        ok = all(med.get(m, 0.0) <= TARGET_LOAD for m in LOAD_METRICS[:2]) \
            and med.get("tpot_ms_p90", 0.0) <= TARGET_LOAD_P90_TPOT
        lines.append("**Under load: median |error| " + ", ".join(f"{m} {v:.1f} %" for m, v in med.items())
                     + f"** — target ≤ {TARGET_LOAD:g} % (throughput, P50 TPOT), ≤ {TARGET_LOAD_P90_TPOT:g} % "
                     f"(P90 TPOT): {'met' if ok else 'NOT met'}.\n")
    lines.append("error_pct = 100·(predicted − measured)/measured; predicted = `backend=sim`, "
                 "measured = `backend=real`, joined on the experiment key and prompt split "
                 "(written to `validation.csv`).\n")
    lines.append(markdown_table(stats, floatfmt="{:.2f}") + "\n")
    if inside_share(val):
        lines.append(inside_share(val) + "\n")
    if val["family"].nunique() > 1:
        fam = error_stats(val[val["metric"].isin(PARITY_METRICS)], by=("family", "metric"))
        lines.append(f"Per schedule family (goal: tokens/s median |error| ≤ {TARGET_MEDIAN:g} %, "
                     f"P90 ≤ {TARGET_P90:g} %):\n")
        lines.append(markdown_table(fam, floatfmt="{:.2f}") + "\n")
    varying = [k for k in JOIN if val[k].astype(str).nunique() > 1]
    table = val[val["metric"].isin(PARITY_METRICS)].pivot_table(
        index=varying or ["pair"], columns="metric", values="error_pct", aggfunc="mean").reset_index()
    table.columns = [f"{c} err %" if c in PARITY_METRICS else c for c in table.columns]
    lines.append("Signed error per experiment (%):\n")
    lines.append(markdown_table(table, floatfmt="{:+.1f}") + "\n")
    lines.append("![parity](parity.png)\n")
    floors = [
        (timing_only_frame(ctx.runs, val), "validation_timing.csv",
         "Latency model alone — each measured run's *own* rounds timed by the profile, rescaled to "
         "its trace-source run's round times (no acceptance transfer, no machine drift)",
         "The rest of the error above is acceptance that differs between the trace prompts and the "
         "predicted ones."),
        (sibling_replay_frame(ctx.runs, val), "validation_noise.csv",
         "Real predicting real — each measured run's rounds timed by the round times of its "
         "trace-source real run (same configuration, run just before, other prompts)",
         "This is the machine's run-to-run timing noise: a latency model calibrated on one run "
         "cannot be expected to beat it."),
    ]
    both = rescaled_frame(ctx.runs, val)
    if len(both):
        both.to_csv(ctx.out_dir / "validation_rescaled.csv", index=False)
        a, b = both["standalone_error_pct"].abs(), both["rescaled_error_pct"].abs()
        drift = both["drift_factor"].dropna()
        lines.append(f"\nStandalone against rescaled prediction, tokens/s over {len(both)} runs "
                     f"(`validation_rescaled.csv`): standalone (the profile"
                     + (f", drift-corrected by a probe (`sim.profile_drift`): target factor "
                        f"{drift.min():.2f}–{drift.max():.2f}"
                        if len(drift) else "") +
                     f") median |error| {a.median():.1f} %, worst {a.max():.1f} %; rescaled to the "
                     f"round times of a real run of the same configuration (`sim.profile_rescale=true`) "
                     f"median {b.median():.1f} %, worst {b.max():.1f} %. The goals apply to the "
                     "standalone prediction: the rescaled one leans on a run of what it predicts.")
    missing = [csv for frame, csv in ((floors[0][0], "validation_timing.csv"),
                                      (both, "validation_rescaled.csv")) if frame.empty]
    if missing:
        lines.append("\n" + missing_files_note(missing, val))
    for frame, csv, what, meaning in floors:
        if len(frame):
            frame.to_csv(ctx.out_dir / csv, index=False)
            err = frame["error_pct"].abs()
            lines.append(f"\n{what}: tokens/s median |error| {err.median():.1f} %, worst "
                         f"{err.max():.1f} %, mean signed {frame['error_pct'].mean():+.1f} % over "
                         f"{len(frame)} runs (`{csv}`). {meaning}")
    own = own_acceptance_frame(ctx.runs, key_of=validation_key, family_of=family,
                               is_measurement=lambda r: run_split(r) not in TRACE_SPLITS)
    if len(own):
        own.to_csv(ctx.out_dir / "validation_own_acceptance.csv", index=False)
        lines += own_acceptance_lines(own, "validation_own_acceptance.csv")
    lines += sizing_lines(ctx.runs, val, out_dir=ctx.out_dir, goal_median=TARGET_MEDIAN, goal_p90=TARGET_P90)
    return "\n".join(lines)


def missing_files_note(missing: list[str], val: pd.DataFrame) -> str:
    """Why this report has no ``missing`` files (the timing-only and rescaled predictions):
    both replay a chain (`sync`) run's rounds, which a tree, async or DSD grid does not have."""
    names = " and ".join(f"`{m}`" for m in missing)
    if not val["schedule"].isin(chains()).any():
        return (f"No {names}: {'they exist' if len(missing) > 1 else 'it exists'} for chain "
                "(`sync`) runs only — their rounds are replayed with the profile — and these "
                f"runs have none (schedules: {', '.join(sorted(set(val['schedule'])))}).")
    return (f"No {names}: no measured `sync` run could be replayed (each needs its "
            "`experiment.yaml` and `rounds.parquet`, the profile it was predicted with, and its "
            "trace-source run beside it).")


def validation_key(run: Run) -> tuple:
    """A run's row key in validation.csv (experiment key, prompt split, DSD point)."""
    s = run.summary
    key = {**{k: s.get(k) for k in JOIN if k != "split"}, "split": run_split(run), "dsd_point": dsd_point(s),
           "load_point": load_point(s)}
    key["temperature"] = float(key["temperature"]) if key["temperature"] is not None else None
    return tuple("-" if key[k] is None else key[k] for k in VJOIN)
