"""Turning loka-stats sketches into `tensor_stats` rows.

loka-schema does not depend on loka-stats: any object with the `Sketch` interface of
`loka.stats` (summary, range_fit, row/block sub-sketches, to_bytes) works here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import polars as pl

from loka.schema.formats import FP8_FORMATS, FP8_MAX
from loka.schema.tables import TENSOR_STATS
from loka.schema.validation import validate


class SketchLike(Protocol):
    amax: float

    def summary(self) -> dict[str, float | int]: ...
    def range_fit(self, format: str, scale: float) -> Any: ...
    def quantile(self, q: float) -> float: ...
    def to_bytes(self) -> bytes: ...

    @property
    def row_amax(self) -> SketchLike | None: ...
    @property
    def block_amax(self) -> SketchLike | None: ...
    @property
    def row_normalized(self) -> SketchLike | None: ...
    @property
    def block_normalized(self) -> SketchLike | None: ...


@dataclass(frozen=True)
class SketchRecord:
    """One operand role of one site over one window of steps."""

    site: str
    role: str
    window: int
    step_first: int
    step_last: int
    samples: int
    sketch: SketchLike


_COPIED = ("count", "zeros", "subnormals", "nan", "pos_inf", "neg_inf", "amax")
_NULLABLE = ("min", "max", "mean", "rms", "p50", "p90", "p99", "p999", "p9999")


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _fit(sketch: SketchLike | None, fmt: str, scale: float) -> dict[str, float | None]:
    if sketch is None:
        return {"underflow": None, "saturated": None, "pred_err": None}
    fit = sketch.range_fit(fmt, scale)
    return {
        "underflow": _finite_or_none(fit.underflow),
        "saturated": _finite_or_none(fit.saturated),
        "pred_err": _finite_or_none(fit.predicted_rel_error),
    }


def _row(rec: SketchRecord) -> dict[str, Any]:
    sk = rec.sketch
    summary = sk.summary()
    row: dict[str, Any] = {
        "site": rec.site,
        "role": rec.role,
        "window": rec.window,
        "step_first": rec.step_first,
        "step_last": rec.step_last,
        "samples": rec.samples,
    }
    row.update({k: summary[k] for k in _COPIED})
    row.update({k: _finite_or_none(summary[k]) for k in _NULLABLE})
    row["row_amax_p50"] = _finite_or_none(sk.row_amax.quantile(0.5)) if sk.row_amax else None
    row["block_amax_p50"] = _finite_or_none(sk.block_amax.quantile(0.5)) if sk.block_amax else None
    for fmt in FP8_FORMATS:
        fmax = FP8_MAX[fmt]
        # Dynamic scaling maps each group's amax to the format's max. Row- and block-normalized
        # sketches hold |x| / group amax, so the same map is a single scale of fmax there.
        tensor_scale = fmax / sk.amax if sk.amax > 0 and math.isfinite(sk.amax) else 1.0
        fits = {
            "tensor": _fit(sk, fmt, tensor_scale),
            "row": _fit(sk.row_normalized, fmt, fmax),
            "block": _fit(sk.block_normalized, fmt, fmax),
        }
        for gran, values in fits.items():
            for what, value in values.items():
                row[f"{fmt}_{gran}_{what}"] = value
    row["sketch"] = sk.to_bytes()
    return row


def tensor_stats_from_sketches(records: Iterable[SketchRecord]) -> pl.DataFrame:
    """A validated `tensor_stats` table with one row per record.

    Quantiles and moments of a sketch that saw no finite value are null; range-fit columns
    for row and block granularity are null unless the sketch was fed row-structured data
    (`Sketch.update_rows`).
    """
    rows = [_row(rec) for rec in records]
    return validate(pl.DataFrame(rows, schema=TENSOR_STATS.schema), "tensor_stats")
