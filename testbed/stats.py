"""Uncertainty of measured figures: bootstrap confidence intervals over prompts × repeats.

A real run measures one value per (prompt, repeat) — a request's tokens/s or TPOT. The prompts
are a sample of the workload and the repeats a sample of the machine's moods, so the interval
resamples both: prompts with replacement, then, within each drawn prompt, its repeats with
replacement (a two-stage cluster bootstrap; with one repeat it is the ordinary bootstrap over
prompts). The statistic is the median of the resampled values (robust to a neighbour's burst);
the interval is the percentile interval of the bootstrap distribution.

A ratio (speedup = tokens/s over the `ar` baseline's) is paired by prompt: both arrays are
resampled with the same prompt indices (and repeat indices), so the prompt-to-prompt variation
they share cancels in the ratio.

Numbers only: no config, no backend (both backends and the report call these).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval."""

    value: float
    low: float
    high: float
    confidence: float = CONFIDENCE
    n: int = 0  # values behind it (prompts × repeats)

    def covers(self, x: float) -> bool:
        return self.low <= x <= self.high

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _grid(values: Any) -> np.ndarray:
    """values as [prompts, repeats] (a 1-D array: one repeat per prompt); NaN marks a missing one."""
    a = np.asarray(values, dtype=float)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"values of shape {a.shape} are not allowed: [prompts] or [prompts, repeats], non-empty")
    return a


def _resample_index(shape: tuple[int, int], resamples: int, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Row (prompt) and column (repeat) indices of `resamples` two-stage bootstrap samples."""
    prompts, repeats = shape
    rows = rng.integers(0, prompts, size=(resamples, prompts))
    cols = rng.integers(0, repeats, size=(resamples, prompts, repeats))
    return rows[:, :, None].repeat(repeats, axis=2), cols


def _percentiles(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.nanpercentile(stats, [tail, 100 - tail])
    return float(lo), float(hi)


def _statistic_ci(values: Any, statistic: Any, *, confidence: float, resamples: int, seed: int
                  ) -> Interval:
    a = _grid(values)
    rows, cols = _resample_index(a.shape, resamples, np.random.default_rng(seed))
    boot = statistic(a[rows, cols].reshape(resamples, -1), axis=1)
    lo, hi = _percentiles(boot, confidence)
    return Interval(float(statistic(a)), lo, hi, confidence, int(np.isfinite(a).sum()))


def median_ci(values: Any, *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
              seed: int = 0) -> Interval:
    """Median of `values` ([prompts, repeats] or [prompts]) and its bootstrap interval."""
    return _statistic_ci(values, np.nanmedian, confidence=confidence, resamples=resamples, seed=seed)


def mean_ci(values: Any, *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
            seed: int = 0) -> Interval:
    """Mean of `values` ([prompts, repeats] or [prompts]) and its bootstrap interval: the
    statistic of a run's headline tokens/s and TPOT (means over its requests), so the interval
    a prediction of those figures is held against."""
    return _statistic_ci(values, np.nanmean, confidence=confidence, resamples=resamples, seed=seed)


def ratio_ci(numerator: Any, denominator: Any, *, confidence: float = CONFIDENCE,
             resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """median(numerator) / median(denominator), paired by prompt (same shape), and its interval."""
    num, den = _grid(numerator), _grid(denominator)
    if num.shape != den.shape:
        raise ValueError(f"numerator {num.shape} and denominator {den.shape} must be paired: the same "
                         "prompts × repeats")
    rows, cols = _resample_index(num.shape, resamples, np.random.default_rng(seed))
    boot_num = np.nanmedian(num[rows, cols].reshape(resamples, -1), axis=1)
    boot_den = np.nanmedian(den[rows, cols].reshape(resamples, -1), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _percentiles(boot_num / boot_den, confidence)
    return Interval(float(np.nanmedian(num) / np.nanmedian(den)), lo, hi, confidence,
                    int(np.isfinite(num).sum()))


def relative_width(iv: Interval) -> float:
    """(high − low) / value: how wide the interval is relative to the figure."""
    return (iv.high - iv.low) / iv.value if iv.value else float("inf")


def percentile_interval(value: float, samples: Any, *, confidence: float = CONFIDENCE) -> Interval:
    """`value` with the percentile interval of its bootstrap replicates `samples`."""
    a = np.asarray(samples, dtype=float)
    if a.size == 0 or not np.isfinite(a).any():
        raise ValueError("samples must hold at least one finite bootstrap replicate")
    lo, hi = _percentiles(a, confidence)
    return Interval(float(value), lo, hi, confidence, int(np.isfinite(a).sum()))
