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

METHOD = "student-t"


def t_cdf(t: float, dof: int) -> float:
    """Student-t CDF for an integer number of degrees of freedom, by the exact finite
    series of Abramowitz & Stegun 26.7.3-4 (used where scipy is not installed)."""
    theta = math.atan2(t, math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2:  # odd: (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)) / pi
        term, total = 1.0, 1.0 if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        a = (theta + s * math.cos(theta) * total) * 2 / math.pi
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + 0.5 * a


# Imported with the package, not at the first verdict: importing scipy.stats takes a
# fraction of a second with the GIL held, which would stall the training loop mid-run.
try:
    from scipy import stats as _stats
except ImportError:  # e.g. a GPU image without scipy: bisect the exact CDF
    _stats = None


@lru_cache(maxsize=4096)
def _t_quantile(confidence: float, dof: int) -> float:
    if _stats is None:
        lo, hi = 0.0, 1.0
        while t_cdf(hi, dof) < confidence:
            hi *= 2
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if t_cdf(mid, dof) < confidence else (lo, mid)
        return 0.5 * (lo + hi)
    return float(_stats.t.ppf(confidence, dof))


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
