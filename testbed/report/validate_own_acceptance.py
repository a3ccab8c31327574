"""Where a family's error comes from: every prediction made again on the *measured* prompts' own
acceptance (`validation_own_acceptance.csv`).

A validate prediction replays the acceptance of other prompts (the trace split) and times it
with the profile scaled by the measured run's probe. Made again with ``acceptance.trace_path``
naming the measured run itself — the same cost model, the same drift correction, no prediction
interval — the prediction no longer depends on how well one split's acceptance carries over to
the other: what error is left is the simulator's timing of that schedule (its per-forward costs,
contention, messages, bookkeeping). The difference between the two errors is the acceptance
transfer. For every family, not only the chain (`validation_timing.csv` rescales the profile to
the run's own round times, which hides a wrong level and exists for `sync` only).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.results import Run

LOAD_METRICS = ("throughput_tok_s", "tpot_ms_p50")  # what a point under load is also judged by


def resimulated(sim_run: Run, edit: Callable[[Any], bool]) -> dict[str, Any] | None:
    """The summary of ``sim_run``'s experiment simulated again after ``edit(exp)`` (which
    returns False where the run does not qualify), without a prediction interval; None when it
    does not qualify or cannot be simulated."""
    import yaml

    from testbed import backends
    from testbed.compose import to_experiment
    from testbed.config import ConfigError
    from testbed.results import build_summary

    exp_file = sim_run.path / "experiment.yaml"
    if not exp_file.exists():
        return None
    try:
        exp = copy.deepcopy(to_experiment(yaml.safe_load(exp_file.read_text())))
        exp.pair.name = sim_run.summary.get("pair", exp.pair.name)
        if not edit(exp):
            return None
        exp.sim.prediction_resamples = 0  # the point prediction is what is compared
        return build_summary(exp, backends.get("sim").run(exp))
    except (ConfigError, FileNotFoundError, ValueError, KeyError, IndexError):
        return None  # e.g. a per-token policy whose features stop where the real run stopped


def own_acceptance_prediction(sim_run: Run, measured_dir: Path) -> dict[str, float] | None:
    """tokens/s and mean accepted length of ``sim_run``'s experiment predicted again on the
    acceptance recorded by the real run in ``measured_dir`` (None: it cannot be replayed)."""
    def edit(exp: Any) -> bool:
        exp.acceptance.trace_path = str(measured_dir)  # one run named: its own rounds are replayed
        return exp.acceptance.oracle == "trace"

    summary = resimulated(sim_run, edit)
    if not summary or not summary.get("tokens_per_s"):
        return None
    out = {"tokens_per_s": float(summary["tokens_per_s"]),
           "mean_accepted_len": float(summary.get("mean_accepted_len") or float("nan"))}
    for m in LOAD_METRICS:  # under load (testbed.metrics.load_metrics)
        if summary.get(m):
            out[m] = float(summary[m])
    return out


def own_acceptance_frame(runs: list[Run], *, key_of: Any, family_of: Any, is_measurement: Any
                         ) -> pd.DataFrame:
    """One row per prediction with a measured run of the same key (the newest, as the probe
    drift picks): standalone, own-acceptance and measured tokens/s with their errors (%).
    ``key_of(run)`` gives a run's join key, ``is_measurement(run)`` says whether a real run
    is a measurement (not a trace source), ``family_of(summary)`` names its family."""
    measured: dict[tuple, Run] = {}
    for run in sorted(runs, key=lambda r: (r.path / "summary.json").stat().st_mtime):
        if run.summary.get("backend") == "real" and is_measurement(run):
            measured[key_of(run)] = run  # the newest wins
    rows = []
    for run in runs:
        s = run.summary
        real = measured.get(key_of(run)) if s.get("backend") == "sim" else None
        if real is None or not s.get("tokens_per_s") or not real.summary.get("tokens_per_s"):
            continue
        own = own_acceptance_prediction(run, real.path)
        if own is None:
            continue
        got = float(real.summary["tokens_per_s"])
        rows.append({"family": family_of(s), "pair": s.get("pair"), "gamma": s.get("gamma"),
                     "workload": s.get("workload"), "temperature": s.get("temperature"),
                     "lookahead": s.get("lookahead", "-"), "measured": got,
                     "standalone": float(s["tokens_per_s"]), "own_acceptance": own["tokens_per_s"],
                     "standalone_error_pct": 100.0 * (float(s["tokens_per_s"]) - got) / got,
                     "own_acceptance_error_pct": 100.0 * (own["tokens_per_s"] - got) / got,
                     "own_accepted_len": own["mean_accepted_len"],
                     "measured_accepted_len": real.summary.get("mean_accepted_len"),
                     **{f"{m}_{kind}_error_pct": 100.0 * (float(v) - float(real.summary[m])) / float(real.summary[m])
                        for m in LOAD_METRICS if own.get(m) and real.summary.get(m)
                        for kind, v in (("standalone", s.get(m)), ("own", own[m])) if v}})
    return pd.DataFrame(rows)


def own_acceptance_lines(frame: pd.DataFrame, csv: str) -> list[str]:
    """The per-family table of the report (empty without rows)."""
    if frame.empty:
        return []
    from testbed.report.context import markdown_table

    extra = {f"{m}_{kind}_median_abs_pct": (f"{m}_{kind}_error_pct", lambda x: x.abs().median())
             for m in LOAD_METRICS for kind in ("standalone", "own") if f"{m}_{kind}_error_pct" in frame}
    table = frame.groupby("family").agg(
        predictions=("measured", "size"),
        standalone_median_abs_pct=("standalone_error_pct", lambda x: x.abs().median()),
        own_acceptance_median_abs_pct=("own_acceptance_error_pct", lambda x: x.abs().median()),
        own_acceptance_mean_signed_pct=("own_acceptance_error_pct", "mean"),
        own_acceptance_worst_abs_pct=("own_acceptance_error_pct", lambda x: x.abs().max()),
        **extra,  # under load: the system's throughput and P50 TPOT too
    ).reset_index()
    return ["\nThe same predictions on the measured prompts' own acceptance (`" + csv + "`): "
            "the trace replayed is the measured run's, the cost model and its drift correction "
            "are unchanged. What error is left is the simulator's timing of the schedule; the "
            "rest of the standalone error is acceptance that differs between the trace prompts "
            "and the predicted ones.\n",
            markdown_table(table, floatfmt="{:.2f}") + "\n"]
