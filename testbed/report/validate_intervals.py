"""Interval columns of validation.csv: the prediction's 95% interval (``sim.prediction_resamples``:
``<metric>_pi95``) and the measurement's, joined like the point values
(testbed/report/sections_validate.py), and whether the prediction lies inside the measurement's
interval.

Both intervals are of the statistic the point values are: tokens/s and TPOT are means over a
run's requests (testbed.metrics.summarize), so the measurement's interval is the mean's over
prompts × repeats (``<metric>_mean_ci95``, testbed.repeats.mean_fields), not the median's that
`real.repeats` reports beside it. A real run that recorded none (one pass, or an older run) gets
it from its own requests: over prompts only, so it covers which prompts were drawn but not the
machine's run-to-run noise (the report says how many intervals are of each kind)."""

from __future__ import annotations

import pandas as pd

from testbed.repeats import mean_fields
from testbed.results import Run

SOURCES = {"sim": ("pi95", "predicted"), "real": ("mean_ci95", "measured")}
FROM_REQUESTS = ("tokens_per_s", "tpot_ms")  # what mean_fields gives from a run's requests


def measured_interval(run: Run, metric: str) -> tuple[list[float] | None, int]:
    """The measurement's interval of `metric` and how many passes it rests on (0: none)."""
    s = run.summary
    iv = s.get(f"{metric}_mean_ci95")
    if isinstance(iv, list | tuple) and len(iv) == 2:
        return list(iv), int(s.get("repeats") or 1)
    if metric not in FROM_REQUESTS:
        return None, 0
    requests = run.frame("requests")
    if requests.empty or not {"generated", "decode_s"} <= set(requests.columns):
        return None, 0
    fields = mean_fields([requests.to_dict("records")], seed=int(s.get("seed") or 0))
    iv = fields.get(f"{metric}_mean_ci95")
    return (list(iv), 1) if iv else (None, 0)


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
            passes = None
            if side == "measured":
                iv, passes = measured_interval(run, m)
            else:
                iv = s.get(f"{m}_{suffix}")
            if isinstance(iv, list | tuple) and len(iv) == 2:
                row = {**key, "metric": m, f"{side}_low": float(iv[0]), f"{side}_high": float(iv[1])}
                if passes is not None:
                    row["measured_passes"] = passes
                rows.append(row)
    return pd.DataFrame(rows)


def add_interval_columns(val: pd.DataFrame, runs: list[Run], *, join: tuple[str, ...],
                         metrics: tuple[str, ...], split_of: object) -> pd.DataFrame:
    """`val` with predicted_low/high, measured_low/high (NaN where not measured) and `inside`
    (the prediction within the measurement's interval; NaN without one)."""
    iv = interval_rows(runs, join, metrics, split_of)
    cols = ["predicted_low", "predicted_high", "measured_low", "measured_high", "measured_passes"]
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
    return out[[*val.columns, *cols, "inside"]]


def inside_share(val: pd.DataFrame) -> str:
    """One line: the share of predictions inside the measurement's interval, if any has one."""
    if "inside" not in val or val["inside"].notna().sum() == 0:
        return ""
    tps = val[(val["metric"] == "tokens_per_s") & val["inside"].notna()]
    if tps.empty:
        return ""
    share = 100 * tps["inside"].mean()
    one_pass = int((tps.get("measured_passes", pd.Series(dtype=float)) <= 1).sum())
    width = ((tps["measured_high"] - tps["measured_low"]) / tps["measured"]).median()
    kinds = (f"{one_pass} of them over prompts only (one pass: `real.repeats=N` adds the "
             "machine's run-to-run noise)" if one_pass else "over prompts × repeats")
    return (f"\nPredictions of tokens/s inside the measurement's 95% interval of the mean: "
            f"{share:.0f} % of {len(tps)} (goal ≥ 80 %); intervals {kinds}, median width "
            f"{100 * width:.0f} % of the measured value. Interval columns of `validation.csv`: "
            "predicted_low/high (`sim.prediction_resamples`), measured_low/high, measured_passes, "
            "inside.")
