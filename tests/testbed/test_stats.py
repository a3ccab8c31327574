"""Bootstrap intervals (testbed/stats.py): they cover the true median at about their nominal rate
on synthetic samples of a known distribution (fixed seeds: the rates below are deterministic)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.stats import mean_ci, median_ci, ratio_ci, relative_width

TRIALS = 300
# Percentile-bootstrap intervals of a median from 30-60 values cover at 0.90-0.97 in the
# literature; the two-stage one is a little conservative. Outside [0.88, 0.995] is a bug.
LOW, HIGH = 0.88, 0.995


def test_median_interval_covers_the_true_median_at_the_nominal_rate() -> None:
    rng = np.random.default_rng(1)
    mu, sigma = math.log(40.0), 0.3  # lognormal tokens/s: true median 40
    hits = sum(median_ci(rng.lognormal(mu, sigma, size=40), resamples=1000, seed=t).covers(40.0)
               for t in range(TRIALS))
    assert LOW <= hits / TRIALS <= HIGH, hits / TRIALS


def test_mean_interval_covers_the_true_mean_of_a_skewed_distribution() -> None:
    rng = np.random.default_rng(5)
    mu, sigma = math.log(40.0), 0.3  # lognormal: true mean exp(mu + sigma²/2) = 41.8, median 40
    mean = math.exp(mu + sigma**2 / 2)
    ivs = [mean_ci(rng.lognormal(mu, sigma, size=40), resamples=1000, seed=t) for t in range(TRIALS)]
    hits = sum(iv.covers(mean) for iv in ivs)
    assert LOW <= hits / TRIALS <= HIGH, hits / TRIALS
    assert sum(iv.value for iv in ivs) / TRIALS == pytest.approx(mean, rel=0.01)


def test_two_stage_interval_covers_with_prompt_and_repeat_noise() -> None:
    # value = prompt effect + the machine's noise per repeat: symmetric, so the population
    # median is the centre
    rng = np.random.default_rng(2)
    centre = 25.0
    hits = 0
    for t in range(TRIALS):
        prompts = centre + rng.normal(0, 3.0, size=(16, 1))
        values = prompts + rng.normal(0, 1.5, size=(16, 3))
        hits += median_ci(values, resamples=1000, seed=t).covers(centre)
    assert LOW <= hits / TRIALS <= HIGH, hits / TRIALS


def test_ratio_interval_is_paired_by_prompt() -> None:
    rng = np.random.default_rng(3)
    prompts = rng.lognormal(math.log(20), 0.5, size=(12, 3))  # prompts differ a lot
    base = prompts * rng.normal(1.0, 0.01, size=prompts.shape)
    fast = 1.5 * prompts * rng.normal(1.0, 0.01, size=prompts.shape)
    iv = ratio_ci(fast, base)
    assert iv.covers(1.5) and relative_width(iv) < 0.2  # pairing cancels the prompts' spread
    assert iv.value == pytest.approx(np.median(fast) / np.median(base))
    unpaired = ratio_ci(fast, base[::-1])  # other prompts' baselines: far wider
    assert relative_width(unpaired) > 2 * relative_width(iv)


def test_more_repeats_narrow_the_interval_and_bad_shapes_are_refused() -> None:
    rng = np.random.default_rng(4)
    widths = [relative_width(median_ci(30 + rng.normal(0, 2, size=(8, r)))) for r in (1, 9)]
    assert widths[1] < widths[0]
    with pytest.raises(ValueError, match="paired"):
        ratio_ci(np.ones((3, 2)), np.ones((3, 1)))
    with pytest.raises(ValueError, match="non-empty"):
        median_ci([])
