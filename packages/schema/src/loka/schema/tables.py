"""The five tables that join LoKA's packages, as polars schemas.

A table is a fixed set of typed columns. Column order here is the canonical order of every
table LoKA writes. `SCHEMA_VERSION` changes whenever a column is added, removed, renamed or
retyped, so that a reader can refuse files it would misread. A column added after version 1
(`Column.since`) may be missing from a frame or from a file of an older version, which then
reads with the column's `default`: that is the migration of older files
(`OLDEST_READABLE_VERSION` onwards); files of a newer version are refused.

Version history: 1, the first; 2, `sites.norm` (the norm each site is fed by, for fusion)
and `plan.norm`, `plan.fuse_norm`; 3, `sites.producer` and `sites.grad_producer` (the ops
that compute each site's input and its output's gradient, where a compiled graph fuses
their quantizations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from loka.schema.formats import FP8_FORMATS, GRANULARITIES, PASSES, ROLES

__all__ = [
    "MAX_GEMM_DIM",
    "SCHEMA_VERSION",
    "SITE_KINDS",
    "TABLES",
    "VERDICTS",
    "Column",
    "Table",
    "table",
]

SCHEMA_VERSION = 3
OLDEST_READABLE_VERSION = 1

# cuBLAS and the Triton launchers take GEMM sizes as 32-bit ints: a larger K, N or M is not
# a shape any backend could run, so a table holding one is wrong, not merely large.
MAX_GEMM_DIM = 2**31 - 1

VERDICTS = ("safe", "unsafe", "undecided")
SITE_KINDS = ("linear", "grouped", "bmm")


@dataclass(frozen=True)
class Range:
    """The values a numeric column may hold (nulls are governed by `Column.nullable`)."""

    low: float = -math.inf
    high: float = math.inf
    nan: bool = False  # NaN allowed (it means "not measured" in a few float columns)
    finite: bool = False  # +-Inf refused

    def describe(self, integer: bool = False) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        parts = []
        if self.low > -math.inf:
            parts.append(f">= {num(self.low)}")
        if self.high < math.inf:
            parts.append(f"<= {num(self.high)}")
        if not integer:
            parts += ["finite"] if self.finite else []
            parts += [] if self.nan else ["not NaN"]
        return ", ".join(parts)


@dataclass(frozen=True)
class Column:
    name: str
    dtype: pl.DataType
    doc: str
    nullable: bool = False
    allowed: tuple[str, ...] | None = None  # closed vocabulary of a string column
    range: Range | None = None  # possible values of a numeric column
    since: int = 1  # the schema version that added the column
    default: Any = None  # what a column added after version 1 reads as where it is missing

    @property
    def optional(self) -> bool:
        """May be missing (then it reads as `default`): added after version 1."""
        return self.since > 1


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    key: tuple[str, ...]  # columns that identify a row; no two rows share a key
    columns: tuple[Column, ...] = field(default_factory=tuple)

    @property
    def schema(self) -> pl.Schema:
        return pl.Schema({c.name: c.dtype for c in self.columns})

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"table {self.name!r} has no column {name!r}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]


# Value ranges by the name of the column: the same name means the same quantity in every
# table. Float columns not listed may hold any value, NaN included.
_DIM = Range(0, MAX_GEMM_DIM)  # 0: a site the probe registered but never saw run
_COUNT = Range(0)
_FRACTION = Range(0, 1)
_TIME = Range(0, finite=True)
_RANGES: dict[str, Range] = {
    "K": _DIM, "N": _DIM, "M_min": _DIM, "M_p50": _DIM, "M_max": _DIM,
    "M_bucket": Range(1, MAX_GEMM_DIM), "groups": Range(1, MAX_GEMM_DIM),
    "calls": _COUNT, "window": _COUNT, "samples": _COUNT, "count": _COUNT, "zeros": _COUNT,
    "subnormals": _COUNT, "nan": _COUNT, "pos_inf": _COUNT, "neg_inf": _COUNT, "n": _COUNT,
    "fwd_ms": _TIME, "bwd_ms": _TIME, "median_ms": _TIME, "tflops": _TIME,
    "time_share": Range(0), "confidence": _FRACTION,
    "amax": Range(0), "budget": Range(0),
    "mean_rel_err": Range(0, nan=True), "std_rel_err": Range(0, nan=True),
    "max_abs_err": Range(0, nan=True),
}  # fmt: skip
for _fmt in FP8_FORMATS:
    for _gran in GRANULARITIES:
        _RANGES[f"{_fmt}_{_gran}_underflow"] = _FRACTION
        _RANGES[f"{_fmt}_{_gran}_saturated"] = _FRACTION


def _c(
    name, dtype, doc, nullable=False, allowed=None, range_=None, since=1, default=None
) -> Column:
    return Column(name, dtype, doc, nullable, allowed, range_ or _RANGES.get(name), since, default)


_I, _F, _S, _B = pl.Int64(), pl.Float64(), pl.String(), pl.Boolean()

SITES = Table(
    "sites",
    "One row per GEMM site of a model: its shapes as observed, and where step time goes.",
    key=("site",),
    columns=(
        _c("site", _S, "module path of the site, as in model.named_modules()"),
        _c("kind", _S, "linear, grouped (several GEMMs in one module) or bmm", allowed=SITE_KINDS),
        _c("K", _I, "reduction size (in_features)"),
        _c("N", _I, "output size (out_features)"),
        _c("M_min", _I, "smallest observed M (rows of the input, batch x tokens)"),
        _c("M_p50", _I, "median observed M"),
        _c("M_max", _I, "largest observed M"),
        _c("calls", _I, "forward calls observed"),
        _c("groups", _I, "GEMMs in the site (1 for a plain linear)"),
        _c("has_bias", _B, "whether the GEMM adds a bias"),
        _c("dtype", _S, "compute dtype of the site as run (e.g. bfloat16)"),
        _c("fwd_ms", _F, "measured forward time per call (GPU events)", nullable=True),
        _c("bwd_ms", _F, "measured backward time per call (dgrad + wgrad)", nullable=True),
        _c("time_share", _F, "share of measured step time spent in this site", nullable=True),
        _c(
            "norm",
            _S,
            "module path of the LayerNorm/RMSNorm whose output is the site's input on every "
            "call and feeds no other linear: the norm loka.mods can fuse into it (null: none, "
            "or not traced, as in tables of schema version 1)",
            nullable=True,
            since=2,
        ),
        _c(
            "producer",
            _S,
            "the op that computed the site's input on every call, as autograd records it "
            "(through views and casts; e.g. gelu, native_layer_norm, addmm): where it is "
            "elementwise or a norm, a compiled graph fuses the input's FP8 quantization into "
            "it (null: calls disagreed, the input needed no gradient, or not traced, as in "
            "tables before schema version 3)",
            nullable=True,
            since=3,
        ),
        _c(
            "grad_producer",
            _S,
            "the op whose backward computes the gradient of the site's output on every call: "
            "the output's one consumer, through views, casts and adds (add: several "
            "consumers' gradients summed); where it is elementwise or a norm, a compiled "
            "graph fuses the dgrad's FP8 quantization of dY into it (null: calls disagreed, "
            "the output left the model (a model output), or not traced)",
            nullable=True,
            since=3,
        ),
    ),
)


def _fit_columns() -> tuple[Column, ...]:
    cols = []
    for fmt in FP8_FORMATS:
        for gran in GRANULARITIES:
            # Null when the sketch saw no finite value; row/block also need row-structured data.
            what = f"{fmt} with {gran}wise dynamic scaling"
            cols += [
                _c(f"{fmt}_{gran}_underflow", _F, f"fraction flushed to zero, {what}", True),
                _c(f"{fmt}_{gran}_saturated", _F, f"fraction saturated, {what}", True),
                _c(f"{fmt}_{gran}_pred_err", _F, f"predicted relative error, {what}", True),
            ]
    return tuple(cols)


TENSOR_STATS = Table(
    "tensor_stats",
    "Statistics of one operand role of one site over a window of steps.",
    key=("site", "role", "window"),
    columns=(
        _c("site", _S, "module path of the site"),
        _c("role", _S, "input, weight or grad_output", allowed=ROLES),
        _c("window", _I, "index of the step window the statistics cover"),
        _c("step_first", _I, "first training step in the window"),
        _c("step_last", _I, "last training step in the window"),
        _c("samples", _I, "sampled tensors merged into the row"),
        _c("count", _I, "values seen"),
        _c("zeros", _I, "exact zeros"),
        _c("subnormals", _I, "values subnormal in their own dtype"),
        _c("nan", _I, "NaN values"),
        _c("pos_inf", _I, "+Inf values"),
        _c("neg_inf", _I, "-Inf values"),
        _c("min", _F, "smallest finite value", nullable=True),
        _c("max", _F, "largest finite value", nullable=True),
        _c("amax", _F, "largest finite |x|"),
        _c("mean", _F, "mean of finite values", nullable=True),
        _c("rms", _F, "root mean square of finite values", nullable=True),
        _c("p50", _F, "median of |x|", nullable=True),
        _c("p90", _F, "90th percentile of |x|", nullable=True),
        _c("p99", _F, "99th percentile of |x|", nullable=True),
        _c("p999", _F, "99.9th percentile of |x|", nullable=True),
        _c("p9999", _F, "99.99th percentile of |x|", nullable=True),
        _c("row_amax_p50", _F, "median over rows of the row amax", nullable=True),
        _c("block_amax_p50", _F, "median over 1x128 blocks of the block amax", nullable=True),
        *_fit_columns(),
        _c("sketch", pl.Binary(), "serialized loka.stats sketch, for exact merges", nullable=True),
    ),
)

SITE_ERRORS = Table(
    "site_errors",
    "Relative error of each GEMM pass of a site under each recipe, on sampled real batches.",
    key=("site", "recipe", "pass"),
    columns=(
        _c("site", _S, "module path of the site"),
        _c("recipe", _S, "recipe string (loka.schema.Recipe)"),
        _c("pass", _S, "fwd, dgrad or wgrad", allowed=PASSES),
        _c("n", _I, "sampled batches the error was measured on"),
        _c(
            "mean_rel_err",
            _F,
            "mean over batches of the balanced relative error: the relative Frobenius error "
            "after dividing each output entry by the norms of the two operand rows that "
            "produce it (equals ||out - ref||_F / ||ref||_F on well-conditioned data)",
        ),
        _c("std_rel_err", _F, "sample standard deviation of the per-batch error", nullable=True),
        _c("lcb_rel_err", _F, "lower confidence bound of the mean error", nullable=True),
        _c("ucb_rel_err", _F, "upper confidence bound of the mean error", nullable=True),
        _c("sqnr_db", _F, "signal-to-quantization-noise ratio over all batches, dB"),
        _c("max_abs_err", _F, "largest absolute error seen", nullable=True),
        _c("bf16_rel_err", _F, "the bf16 GEMM's own error on the same batches", nullable=True),
        _c("budget", _F, "error budget the verdict is against"),
        _c("confidence", _F, "confidence level of the bounds (e.g. 0.95)"),
        _c("method", _S, "how the bounds were computed (e.g. student-t)"),
        _c("verdict", _S, "safe, unsafe or undecided", allowed=VERDICTS),
        _c("emulated", _B, "true if FP8 was emulated, false if run on FP8 hardware"),
        _c("step_last", _I, "last training step that contributed"),
    ),
)

KERNEL_BENCH = Table(
    "kernel_bench",
    "Measured (or estimated) time of one backend x recipe x pass at one shape on one device.",
    key=("device", "backend", "recipe", "pass", "M_bucket", "K", "N", "groups"),
    columns=(
        _c("device", _S, "GPU name as torch reports it"),
        _c("capability", _S, "compute capability, e.g. 9.0"),
        _c("driver", _S, "driver / CUDA runtime version"),
        _c("torch_version", _S, "torch version the numbers were taken with"),
        _c("triton_version", _S, "triton version the numbers were taken with"),
        _c("backend", _S, "registry name of the backend"),
        _c("recipe", _S, "recipe string"),
        _c("pass", _S, "fwd, dgrad or wgrad", allowed=PASSES),
        _c("M_bucket", _I, "M rounded to its bucket (a power of two)"),
        _c("K", _I, "reduction size of the linear (in_features)"),
        _c("N", _I, "output size of the linear (out_features)"),
        _c("groups", _I, "GEMMs per launch (1 unless grouped)"),
        _c("median_ms", _F, "median time, quantization and transposes included"),
        _c("tflops", _F, "achieved TFLOP/s at that time"),
        _c("estimated", _B, "true if from a cost model rather than measured here"),
    ),
)

PLAN = Table(
    "plan",
    "The chosen backend and recipe per site and pass, and why every other candidate lost.",
    key=("site", "pass"),
    columns=(
        _c("site", _S, "module path of the site"),
        _c("pass", _S, "fwd, dgrad or wgrad", allowed=PASSES),
        _c("backend", _S, "chosen backend"),
        _c("recipe", _S, "chosen recipe (bf16 when the pass stays in bf16)"),
        _c("K", _I, "in_features the plan was made for"),
        _c("N", _I, "out_features the plan was made for"),
        _c("M_p50", _I, "median M the plan was made for"),
        _c(
            "bf16_ms",
            _F,
            "time of the bf16 baseline at this shape (NaN: not timed)",
            range_=Range(0, nan=True),
        ),
        _c(
            "predicted_ms",
            _F,
            "time of the chosen candidate (NaN: not timed)",
            range_=Range(0, nan=True),
        ),
        _c("predicted_speedup", _F, "bf16_ms / predicted_ms", range_=Range(0, nan=True)),
        _c("predicted_rel_err", _F, "upper confidence bound of the error", nullable=True),
        _c("budget", _F, "error budget of the site and pass", nullable=True),
        _c("estimated", _B, "true if times come from a cost model, not this GPU"),
        _c("reason", _S, "why the chosen candidate won"),
        _c(
            "rejected",
            pl.List(pl.Struct({"backend": _S, "recipe": _S, "reason": _S})),
            "every candidate that lost, with the reason",
        ),
        _c("norm", _S, "the norm feeding the site (sites.norm); null: none", True, since=2),
        _c(
            "fuse_norm",
            _B,
            "the forward runs that norm and the quantization of its output as one kernel",
            since=2,
            default=False,
        ),
    ),
)

TABLES: dict[str, Table] = {
    t.name: t for t in (SITES, TENSOR_STATS, SITE_ERRORS, KERNEL_BENCH, PLAN)
}


def table(name: str) -> Table:
    """The table definition called `name` (one of `TABLES`)."""
    try:
        return TABLES[name]
    except KeyError:
        raise KeyError(f"unknown table {name!r}; LoKA's tables are {sorted(TABLES)}") from None
