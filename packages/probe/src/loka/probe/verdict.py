"""Confidence bounds of a site's mean per-batch error, and the verdict against a budget.

Method: Student-t. The per-batch errors of a (site, recipe, pass) are treated as
independent draws (rows are resampled on every sampled step, and sampled steps are spread
over training); the one-sided bounds at confidence c are

    mean -+ t_c(n - 1) * s / sqrt(n)

with s the sample standard deviation. `safe` when the upper bound is within the budget,
`unsafe` when the lower bound exceeds it, `undecided` otherwise or below `min_batches`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import stats

METHOD = "student-t"


@lru_cache(maxsize=4096)
def _t_quantile(confidence: float, dof: int) -> float:
    return float(stats.t.ppf(confidence, dof))


@dataclass(frozen=True)
class Bounds:
    n: int
    mean: float
    std: float | None
    lcb: float | None
    ucb: float | None


def mean_bounds(values: np.ndarray, confidence: float) -> Bounds:
    """Mean of `values` with one-sided Student-t bounds (None below two values)."""
    n = int(values.size)
    if n == 0:
        return Bounds(0, math.nan, None, None, None)
    mean = float(values.mean())
    if n < 2:
        return Bounds(n, mean, None, None, None)
    std = float(values.std(ddof=1))
    half = _t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return Bounds(n, mean, std, max(mean - half, 0.0), mean + half)


def decide(bounds: Bounds, budget: float, min_batches: int) -> str:
    if bounds.n < max(min_batches, 2) or bounds.ucb is None or bounds.lcb is None:
        return "undecided"
    if bounds.ucb <= budget:
        return "safe"
    if bounds.lcb > budget:
        return "unsafe"
    return "undecided"
