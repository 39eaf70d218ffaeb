"""The statistics of `loka.dispatch.verify`: planned against bf16 step times, in blocks.

Blocks alternate planned, bf16, planned, bf16...; each block is summarized by the median of
its kept step times (a median, because a step that hit a data-loader stall or a GC pause is
an outlier, not a speed). The speedup is median(bf16 blocks) / median(planned blocks); its
interval is a Student-t interval on the log ratios of the pairs (planned block i, bf16 block
i), exponentiated. Pairing adjacent blocks leaves slow drift (clocks, temperature, the
data) out of the comparison but for one block's worth, where pooled steps would count all
of it as a difference between the variants.

The t quantile is computed here (exact for integer degrees of freedom) so that this module
needs neither scipy.stats (slow to import mid-training) nor loka.probe.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _t_two_sided(t: float, dof: int) -> float:
    """P(|T| < t) for Student's t with `dof` (integer >= 1) degrees of freedom: the closed
    forms of the even and odd cases in theta = atan(t / sqrt(dof))."""
    theta = math.atan(t / math.sqrt(dof))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if dof % 2 == 0:
        term = total = 1.0
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if dof == 1:
        return 2.0 * theta / math.pi
    term = total = 1.0
    for k in range(1, (dof - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2.0 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(confidence: float, dof: int) -> float:
    """The t such that P(|T| < t) = `confidence` (a two-sided interval's half-width in
    standard errors), by bisection on the exact CDF."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, dof) < confidence:
        lo, hi = hi, hi * 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _t_two_sided(mid, dof) < confidence:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Comparison:
    """Planned against bf16 over one round of blocks."""

    speedup: float  # median(bf16 block medians) / median(planned block medians)
    low: float  # the interval on the paired ratios, at `confidence`
    high: float
    confidence: float
    pairs: int


def compare(planned: Sequence[float], bf16: Sequence[float], confidence: float = 0.9) -> Comparison:
    """Compare block medians (in the order measured; planned[i] ran just before bf16[i])."""
    if len(planned) != len(bf16):
        raise ValueError(f"{len(planned)} planned blocks against {len(bf16)} bf16 blocks")
    if len(planned) < 2:
        raise ValueError("at least two pairs of blocks are needed for an interval")
    if any(not (x > 0 and math.isfinite(x)) for x in (*planned, *bf16)):
        raise ValueError("block times must be positive and finite")
    logs = [math.log(b / p) for p, b in zip(planned, bf16, strict=True)]
    n = len(logs)
    mean = statistics.fmean(logs)
    half = t_quantile(confidence, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return Comparison(
        speedup=statistics.median(bf16) / statistics.median(planned),
        low=math.exp(mean - half),
        high=math.exp(mean + half),
        confidence=confidence,
        pairs=n,
    )
