"""Repeated, interleaved measurement (``real.repeats=N``): the order, and the summary fields.

Drift on a shared machine (a neighbour's job, the CPU clock) moves every measurement taken
while it lasts. Measuring the configurations of a grid point one after another, N times each,
would hand one of them the drift; interleaving them — A ar B A ar B … — spreads it over all of
them alike, and the `ar` baseline, measured between the others in every pass, is as close in
time to each as it can be (not once before or after them all).

The summary gets, per figure (tokens/s and TPOT of the configuration, speedup over `ar`), the
median over prompts × repeats and its 95% bootstrap interval (testbed/stats.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from testbed.schedules import BASELINE  # the `ar` baseline
from testbed.stats import mean_ci, median_ci, ratio_ci


def interleaved_order(configs: Sequence[str], repeats: int, baseline: str | None = BASELINE
                      ) -> list[tuple[str, int]]:
    """(configuration, repeat index) in measuring order: every pass measures each configuration
    once, with the baseline in the middle of the pass (between the others: A ar B; with one
    configuration the pass is A ar, so the sequence alternates A ar A ar …)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed: an integer >= 1")
    names = [c for c in configs if c != baseline]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"configs={list(configs)} is not allowed: distinct names besides {baseline!r}")
    one_pass = list(names)
    if baseline is not None:
        one_pass.insert(max(1, len(names) // 2), baseline)
    return [(name, r) for r in range(repeats) for name in one_pass]


def per_request(requests: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """tokens/s and TPOT (ms) of each request of one measurement, by request order."""
    tps, tpot = [], []
    for r in requests:
        ok = r["decode_s"] > 0 and r["generated"] > 0
        tps.append(r["generated"] / r["decode_s"] if ok else float("nan"))
        tpot.append(1e3 * r["decode_s"] / r["generated"] if ok else float("nan"))
    return {"tokens_per_s": tps, "tpot_ms": tpot}


def _pass_grid(passes: Sequence[Sequence[dict[str, Any]]], metric: str) -> np.ndarray:
    """[prompts, passes] of one metric per request."""
    return np.array([per_request(reqs)[metric] for reqs in passes], dtype=float).T


def mean_fields(passes: Sequence[Sequence[dict[str, Any]]], seed: int = 0) -> dict[str, Any]:
    """``<metric>_mean`` and ``<metric>_mean_ci95`` for tokens/s and TPOT: the headline statistic
    (the mean over requests, testbed.metrics.summarize) over prompts × passes, with its 95%
    bootstrap interval. `passes` are the request records of each measurement of the same prompts
    (one pass: the interval covers which prompts were drawn, not the machine's run-to-run noise)."""
    out: dict[str, Any] = {}
    for metric in ("tokens_per_s", "tpot_ms"):
        grid = _pass_grid(passes, metric)
        if grid.size == 0 or not np.isfinite(grid).any():
            continue
        iv = mean_ci(grid, seed=seed)
        out[f"{metric}_mean"] = iv.value
        out[f"{metric}_mean_ci95"] = [iv.low, iv.high]
    return out


def repeat_summary(measured: dict[str, list[Sequence[dict[str, Any]]]], config: str,
                   baseline: str | None = BASELINE, seed: int = 0) -> dict[str, Any]:
    """Summary fields from every measurement: ``measured[name][repeat]`` is that measurement's
    request records (the same prompts, in the same order, every time)."""
    def grid(name: str, metric: str) -> np.ndarray:  # [prompts, repeats]
        return _pass_grid(measured[name], metric)

    out: dict[str, Any] = {"repeats": len(measured[config]), **mean_fields(measured[config], seed)}
    for metric in ("tokens_per_s", "tpot_ms"):
        iv = median_ci(grid(config, metric), seed=seed)
        out[f"{metric}_median"] = iv.value
        out[f"{metric}_ci95"] = [iv.low, iv.high]
    out["repeat_tokens_per_s"] = {name: [float(np.nanmean(per_request(reqs)["tokens_per_s"]))
                                         for reqs in runs] for name, runs in measured.items()}
    if baseline is not None and baseline in measured:
        iv = ratio_ci(grid(config, "tokens_per_s"), grid(baseline, "tokens_per_s"), seed=seed)
        out["speedup_median"] = iv.value
        out["speedup_ci95"] = [iv.low, iv.high]
        base = median_ci(grid(baseline, "tokens_per_s"), seed=seed)
        out["ar_tokens_per_s_median"] = base.value
        out["ar_tokens_per_s_ci95"] = [base.low, base.high]
    return out
