"""Smoothing of measured latency tables (real/calibrate/profile.py, real/calibrate/tp.py): per context, a
monotone (isotonic) fit in k; across contexts, a robust (Theil–Sen) line per k, so that one noisy
timing cannot bend the profile the simulator reads."""

from __future__ import annotations

import statistics

SCHEMA = 2  # 2: per-model "tp" tables, "allreduce", links.gloo_round_trip (real/calibrate/tp.py)



def isotonic(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a forward over more tokens is
    never cheaper, so a decrease is noise; unlike a running maximum, one outlier is averaged
    with its neighbours instead of raising everything after it."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]]
    out: list[float] = []
    for m, w in blocks:
        out += [m] * int(w)
    return out


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Robust line y = a + b·x: median of pairwise slopes, median intercept."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    b = statistics.median(slopes)
    a = statistics.median([y - b * x for x, y in zip(xs, ys)])
    return a, b


def smooth_table(raw: list[list[float]], context: list[int]) -> list[list[float]]:
    """raw[context][k] -> per k a robust line in context (attention is linear in the cache
    length), non-negative, then non-decreasing in k per context."""
    cols = list(zip(*raw))
    fitted_cols = []
    for col in cols:
        a, b = theil_sen([float(c) for c in context], list(col))
        b = max(b, 0.0)
        fitted_cols.append([max(a + b * c, 1e-7) for c in context])
    rows = [list(r) for r in zip(*fitted_cols)]
    return [isotonic(r) for r in rows]
