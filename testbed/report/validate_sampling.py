"""How much of a validation error the choice of prompts explains, and how many prompts per split
would make the fidelity goals testable.

A prediction replays the acceptance of the *trace* prompts and is compared with a measurement on
other prompts (the *test* split): no prediction replays its own prompts. Acceptance differs from
prompt to prompt, so the two splits' mean tokens per verification differ even where the
simulator is exact. If one prompt's tokens per verification has coefficient of variation ``c``
(between prompts), the relative difference of the means of ``n_trace`` and ``n_test`` prompts has
standard deviation ``c·√(1/n_trace + 1/n_test)`` and its median |·| is ``0.674`` times that
(normal approximation; ``1.645`` times for the 90th percentile). Tokens/s inherits it about one
for one where a round's time does not depend on how much it accepts (a chain at fixed γ).

From the measured runs and their trace-source runs this gives, per schedule family: the
observed transfer (trace mean against test mean), the transfer expected from ``c`` at the sweep's
size, and the prompts per split at which the transfer alone stays within the goals: median
|error| ≤ 5 % and P90 ≤ 10 %.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.results import Run

Z_MEDIAN, Z_P90 = 0.674, 1.645  # quantiles 0.75 and 0.95 of N(0, 1): median and P90 of |N(0, 1)|


def per_prompt_tokens_per_verification(run: Run) -> np.ndarray:
    """Each request's tokens per verification (emitted / rounds) in `run` (empty if unrecorded)."""
    rounds = run.frame("rounds")
    if rounds.empty or not {"request_id", "emitted"} <= set(rounds.columns):
        return np.array([])
    g = rounds.groupby("request_id")["emitted"]
    return (g.sum() / g.size()).to_numpy(dtype=float)


def pooled_cv(a: np.ndarray, b: np.ndarray) -> float:
    """Between-prompt coefficient of variation of two samples pooled around their own means (so
    that a difference of the means does not count as spread); NaN below 3 prompts in all."""
    dof = len(a) + len(b) - 2
    if dof < 1:
        return float("nan")
    ss = float(((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum())
    return math.sqrt(ss / dof) / float(np.concatenate([a, b]).mean())


def expected_transfer_pct(cv: float, n_trace: int, n_test: int, z: float = Z_MEDIAN) -> float:
    """The `z` quantile of |relative difference| (%) of two prompt samples' means."""
    return 100.0 * z * cv * math.sqrt(1.0 / n_trace + 1.0 / n_test)


def prompts_needed(cv: float, goal_pct: float, z: float = Z_MEDIAN) -> int:
    """Prompts per split (trace = test = n) for which the transfer's `z` quantile is ≤ goal_pct."""
    if not cv > 0:
        return 1
    return max(1, math.ceil(2.0 * (z * cv * 100.0 / goal_pct) ** 2))


def sampling_frame(runs: list[Run], val: pd.DataFrame) -> pd.DataFrame:
    """One row per measured real run with a trace-source run beside it: family, prompts per split,
    between-prompt CV, observed and expected transfer (%)."""
    from testbed.report.validate_runs import family, measured_with_source

    rows = []
    for run, src, key in measured_with_source(runs, val):
        test, trace = per_prompt_tokens_per_verification(run), per_prompt_tokens_per_verification(src)
        if len(test) == 0 or len(trace) == 0:
            continue
        cv = pooled_cv(trace, test)
        rows.append({"family": family(run.summary), **key,
                     "n_trace": len(trace), "n_test": len(test), "cv": cv,
                     "transfer_pct": 100.0 * (trace.mean() - test.mean()) / test.mean(),
                     "expected_median_pct": expected_transfer_pct(cv, len(trace), len(test))
                     if cv == cv else float("nan")})
    return pd.DataFrame(rows)


def family_sizing(frame: pd.DataFrame, goal_median: float, goal_p90: float) -> pd.DataFrame:
    """Per family: points, prompts per split, median CV, observed and expected median |transfer|,
    and the prompts per split at which the transfer alone meets the median and the P90 goal (the
    P90 one from the family's 90th-percentile CV: its hardest points)."""
    rows = []
    for fam, f in frame.dropna(subset=["cv"]).groupby("family", sort=False):
        cv_med, cv_p90 = float(f["cv"].median()), float(f["cv"].quantile(0.9))
        n_now = int(f[["n_trace", "n_test"]].min(axis=1).median())
        need = max(prompts_needed(cv_med, goal_median), prompts_needed(cv_p90, goal_p90, Z_P90))
        rows.append({"family": fam, "points": len(f), "prompts per split": n_now,
                     "CV between prompts": cv_med, "observed |transfer| %": float(f["transfer_pct"].abs().median()),
                     "expected |transfer| %": float(f["expected_median_pct"].median()),
                     "prompts per split for the goals": need,
                     "× real-run time": need / max(n_now, 1)})
    return pd.DataFrame(rows)


def sizing_lines(runs: list[Run], val: pd.DataFrame, *, out_dir: Path, goal_median: float,
                 goal_p90: float) -> list[str]:
    """The report's paragraph and table, `validation_sampling.csv` beside them (nothing when no
    measured run has a trace-source run with per-request rounds)."""
    frame = sampling_frame(runs, val)
    sizing = family_sizing(frame, goal_median, goal_p90) if len(frame) else pd.DataFrame()
    if sizing.empty:
        return []
    from testbed.report.context import markdown_table

    frame.to_csv(out_dir / "validation_sampling.csv", index=False)
    return [f"\nAcceptance transfer between prompt splits (`validation_sampling.csv`): each "
            "prediction replays the trace prompts' acceptance and is compared on other prompts. "
            "With a between-prompt coefficient of variation c of tokens per verification, the two "
            "splits' means differ by 0.674·c·√(1/n_trace + 1/n_test) in the median even for an "
            f"exact simulator. Prompts per split at which that alone stays within median ≤ "
            f"{goal_median:g} % and P90 ≤ {goal_p90:g} % (tokens/s follows it about one for one "
            "at a fixed γ; the real runs' time grows in proportion):\n",
            markdown_table(sizing, floatfmt="{:.2f}")]
