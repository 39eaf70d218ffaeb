"""Plain-text tables of a sketch: its statistics and its FP8 range fit per granularity."""

from collections.abc import Sequence

from loka.stats import FP8_FORMATS, RangeFit, Sketch

Row = Sequence[str]


def table(header: Row, rows: Sequence[Row], text_columns: int = 1) -> str:
    """Columns padded to their widest cell: the first `text_columns` left-aligned, the
    numbers after them right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Row) -> str:
        padded = (
            c.ljust(w) if i < text_columns else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _number(v: float) -> str:
    return f"{v:.4g}"


def _fraction(v: float) -> str:
    return "0" if v == 0 else f"{v:.2e}"


def statistics_table(named: Sequence[tuple[str, Sketch]]) -> str:
    """One row per sketch: counts, extremes, RMS and the tail quantiles of |x|."""
    keys = ["count", "zeros", "subnormals", "nan", "pos_inf", "neg_inf", "amax", "rms"]
    quantiles = ["p50", "p90", "p99", "p999", "p9999"]
    rows = []
    for name, sketch in named:
        s = sketch.summary()
        rows.append(
            [name]
            + [str(s[k]) if isinstance(s[k], int) else _number(s[k]) for k in keys]
            + [_number(s[q]) for q in quantiles]
        )
    return table(["values", *keys, *(f"|x| {q}" for q in quantiles)], rows)


def _fit_row(fmt: str, granularity: str, rule: str, factor: float, fit: RangeFit) -> list[str]:
    return [
        fmt,
        granularity,
        rule,
        f"{factor:.4g}",
        _fraction(fit.saturated),
        _fraction(fit.underflow),
        _fraction(fit.subnormal),
        f"{fit.predicted_rel_error:.3e}",
    ]


def range_fit_table(sketch: Sketch) -> str:
    """The FP8 range fit of tensorwise, rowwise and blockwise dynamic scaling, at the amax
    scale and at the scale that minimizes the predicted error.

    `factor` is the scale relative to the dynamic one (fp8_max / amax of the tensor, row or
    block): 1 is plain dynamic scaling. Rowwise and blockwise fits come from the values
    normalized by their row's / tile's amax, so every row or tile weighs alike there.
    """
    granularities: list[tuple[str, Sketch, float]] = []
    if sketch.amax > 0:
        granularities.append(("tensor", sketch, sketch.amax))
    if sketch.row_normalized is not None and sketch.row_normalized.amax > 0:
        granularities.append(("row", sketch.row_normalized, 1.0))
    if sketch.block_normalized is not None and sketch.block_normalized.amax > 0:
        granularities.append((f"block 1x{sketch.block}", sketch.block_normalized, 1.0))
    rows = []
    for fmt, spec in FP8_FORMATS.items():
        for name, values, amax in granularities:
            dynamic = spec.max / amax
            rows.append(_fit_row(fmt, name, "amax", 1.0, values.range_fit(fmt, dynamic)))
            scale, fit = values.optimal_scale(fmt)
            rows.append(_fit_row(fmt, name, "optimal", scale / dynamic, fit))
            if name == "tensor":
                scale, fit = values.optimal_scale(fmt, pow2=True)
                rows.append(_fit_row(fmt, name, "optimal pow2", scale / dynamic, fit))
    header = [
        "format",
        "scaling",
        "scale",
        "factor",
        "saturated",
        "underflow",
        "subnormal",
        "pred. rel err",
    ]
    return table(header, rows, text_columns=3)


def report(title: str, sketch: Sketch) -> str:
    named = [("all", sketch)]
    for label, sub in [("row amax", sketch.row_amax), ("block amax", sketch.block_amax)]:
        if sub is not None:
            named.append((label, sub))
    exponents = sketch.exponent_histogram()
    span = f"2^{min(exponents)} .. 2^{max(exponents) + 1}" if exponents else "none"
    return "\n\n".join(
        [
            title,
            statistics_table(named),
            f"nonzero |x| spans {span}; quantiles within a relative "
            f"{sketch.relative_error:.2g} of exact",
            "FP8 range fit: fractions of finite values that saturate, flush to zero or land\n"
            "in FP8's subnormal range, and the predicted relative Frobenius error of\n"
            "quantize-dequantize; factor = scale / dynamic scale (fp8_max / amax); row and\n"
            "block fits weigh every row or tile alike",
            range_fit_table(sketch),
        ]
    )
