"""Interval columns of validation.csv: the prediction's 95% interval (``sim.prediction_resamples``:
``<metric>_pi95``) and the measurement's (``real.repeats``: ``<metric>_ci95``), joined like the
point values (testbed/report/sections_validate.py), and whether the prediction lies inside the
measurement's interval."""

from __future__ import annotations

import pandas as pd

from testbed.results import Run

SOURCES = {"sim": ("pi95", "predicted"), "real": ("ci95", "measured")}


def interval_rows(runs: list[Run], join: tuple[str, ...], metrics: tuple[str, ...],
                  split_of: object) -> pd.DataFrame:
    """(join key…, metric, <predicted|measured>_low/high) for every run with intervals."""
    rows = []
    for run in runs:
        s = run.summary
        if s.get("backend") not in SOURCES:
            continue
        suffix, side = SOURCES[s["backend"]]
        key = {k: s.get(k) for k in join if k != "split"}
        key["split"] = split_of(run)  # type: ignore[operator]
        for m in metrics:
            iv = s.get(f"{m}_{suffix}")
            if isinstance(iv, list | tuple) and len(iv) == 2:
                rows.append({**key, "metric": m, f"{side}_low": float(iv[0]), f"{side}_high": float(iv[1])})
    return pd.DataFrame(rows)


def add_interval_columns(val: pd.DataFrame, runs: list[Run], join: tuple[str, ...],
                         metrics: tuple[str, ...], split_of: object) -> pd.DataFrame:
    """`val` with predicted_low/high, measured_low/high (NaN where not measured) and `inside`
    (the prediction within the measurement's interval; NaN without one)."""
    iv = interval_rows(runs, join, metrics, split_of)
    cols = ["predicted_low", "predicted_high", "measured_low", "measured_high"]
    if iv.empty:
        return val.assign(**{c: float("nan") for c in cols}, inside=float("nan"))
    iv["temperature"] = iv["temperature"].astype(float)
    keys = [*join, "metric"]
    merged = iv.groupby(keys, dropna=False).mean(numeric_only=True).reset_index()
    out = val.merge(merged, on=keys, how="left")
    for c in cols:
        if c not in out:
            out[c] = float("nan")
    has = out["measured_low"].notna()
    out["inside"] = (out["predicted"].between(out["measured_low"], out["measured_high"])
                     .where(has).astype(float))
    return out


def inside_share(val: pd.DataFrame) -> str:
    """One line: the share of predictions inside the measurement's interval, if any has one."""
    if "inside" not in val or val["inside"].notna().sum() == 0:
        return ""
    tps = val[(val["metric"] == "tokens_per_s") & val["inside"].notna()]
    if tps.empty:
        return ""
    share = 100 * tps["inside"].mean()
    return (f"\nPredictions of tokens/s inside the measurement's 95% interval (`real.repeats`): "
            f"{share:.0f} % of {len(tps)} (goal ≥ 80 %). Interval columns of `validation.csv`: "
            "predicted_low/high (`sim.prediction_resamples`), measured_low/high, inside.")
