"""The candidates of each pass at a site: every backend timed (`kernel_bench`) for a recipe
Probe measured there (`site_errors`), looked up by the recipe's speed key (formats,
granularity, scaling kind). A candidate is eligible when its verdict is safe (or undecided,
if allowed), its accumulation mode is allowed and its backend runs in the plan's mode;
every other one is rejected with the reason. A site fed by its own norm (`sites.norm`) also
gets, in eager plans, the forward candidates that fuse the norm with the quantization of x.
In a compiled plan, a site whose input an elementwise op or a norm computed
(`sites.producer`) has its forward's quantization of x costed as inductor runs it: fused into
that op (the producer rows of kernel_bench), not standalone; likewise its dgrad's
quantization of dY, fused into the backward of the op that consumed its output
(`sites.grad_producer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import polars as pl

from loka.dispatch.bench.candidates import (
    BF16_BACKEND,
    INDUCTOR_BF16_BACKEND,
    LAYER_NORM_BACKEND,
    NORM_QUANTIZE_BACKEND,
    QUANTIZE_BACKEND,
    fusable,
    fuses_in_graph,
    in_graph_quant_ms,
    m_bucket,
    producer_backend,
    producer_kind,
    speed_key,
)
from loka.dispatch.planner.config import PlanConfig
from loka.kernels import registry
from loka.schema import PASSES, Recipe

if TYPE_CHECKING:
    from loka.dispatch.planner.sharing import Combo

SAFE, UNDECIDED = "safe", "undecided"
INVALID = "invalid"  # a site_errors row whose numbers cannot be checked (NaN, inf)


@dataclass(frozen=True)
class Option:
    """One candidate of one pass at one site, with its standalone timing."""

    backend: str
    recipe: Recipe
    pass_: str
    median_ms: float
    gemm_ms: float
    quant_ms: float
    estimated: bool
    err: float | None  # upper confidence bound (mean when no bound)
    budget: float | None
    fused: bool = False  # the norm feeding the site is fused with the quantization of x
    # compiled plans: x's (fwd) or dY's (dgrad) quantization costed fused into the op
    # computing it (its kind), and what that saved against the standalone quantization (ms)
    in_graph: str | None = None
    in_graph_saved_ms: float = 0.0

    @property
    def is_bf16(self) -> bool:
        return self.recipe.is_bf16

    @property
    def label(self) -> str:
        return f"{self.backend}+norm" if self.fused else self.backend


class Timing(NamedTuple):
    """The times (ms) of a kernel_bench row."""

    median_ms: float
    gemm_ms: float
    quant_ms: float


class SiteShape(NamedTuple):
    """The shape a site is planned at: its median M's bucket, K and N."""

    M_bucket: int
    K: int
    N: int


class BenchKey(NamedTuple):
    """Where a kernel_bench row applies: the M bucket, K and N of a pass (N = 0: a norm)."""

    M_bucket: int
    K: int
    N: int
    pass_: str


KernelIndex = dict[BenchKey, list[dict]]


@dataclass
class SiteChoice:
    """One site's candidates, per pass, and its valid combinations of them (fastest first)."""

    site: str
    K: int
    N: int
    M: int
    share: float | None
    bf16: dict[str, Option]
    options: dict[str, list[Option]]
    rejected: dict[str, list[dict]]
    combos: list[Combo] = field(default_factory=list)
    best_gemm: dict[str, float] = field(default_factory=dict)  # fastest FP8 GEMM, safe or not
    # the fastest FP8 candidate whole (quantizations included), safe or not
    best_total: dict[str, float] = field(default_factory=dict)
    chosen: int = 0
    note: str | None = None  # why the site stays bf16 without any evaluation
    undecided: list[dict] = field(default_factory=list)  # site_errors rows refused as undecided
    norm: str | None = None  # the norm feeding the site alone (sites.norm)
    producer: str | None = None  # the op computing the site's input (sites.producer)
    # the op whose backward computes the site's output gradient (sites.grad_producer)
    grad_producer: str | None = None

    def current(self) -> Combo:
        return self.combos[self.chosen]


def kernel_index(kernel_bench: pl.DataFrame) -> KernelIndex:
    keyed = kernel_bench.filter(pl.col("groups") == 1).with_columns(
        pl.col("recipe").map_elements(speed_key, return_dtype=pl.String).alias("_speed")
    )
    index: KernelIndex = {}
    for row in keyed.iter_rows(named=True):
        index.setdefault(BenchKey(row["M_bucket"], row["K"], row["N"], row["pass"]), []).append(row)
    return index


def _timing(row: dict, mode: str = "compiled", charge_host: bool = True) -> Timing:
    """(median, GEMM, quantization) ms of a kernel_bench row; in an eager plan the pass's
    measured extra host time (`host_ms`, see `bench.host`) is charged to its median, since an
    eager step pays it unless the device is the slower side (`PlanConfig.charge_host`)."""
    gemm = row.get("gemm_ms")
    quant = row.get("quant_ms")
    median = row["median_ms"]
    host = row.get("host_ms")
    if mode == "eager" and charge_host and host is not None and math.isfinite(host):
        median += host
    return Timing(median, median if gemm is None else gemm, 0.0 if quant is None else quant)


def _in_place(timing: Timing, pass_: str, config: PlanConfig) -> Timing:
    """`timing` of an FP8 pass as the planned step pays it: a wgrad pass's quantization
    charged at `PlanConfig.wgrad_quant_charge()` times its standalone time."""
    factor = config.quant_charge(pass_)
    if factor == 1.0:
        return timing
    extra = (factor - 1.0) * timing.quant_ms
    return Timing(timing.median_ms + extra, timing.gemm_ms, timing.quant_ms + extra)


def _bf16_baseline(rows: list[dict], mode: str) -> dict | None:
    """The bf16 row a pass's FP8 options must beat: `torch.bf16`'s, or in a compiled plan
    the faster of it and `inductor.bf16`'s (the GEMM at padded dims, which inductor runs
    instead where padding is faster; InterFormer xl's 7507-wide fc1 took 8.5 ms unpadded and
    a plan that compared FP8 with that predicted 1.24x for a step measured at 1.02x).
    None without a `torch.bf16` row."""
    plain = [r for r in rows if r["_speed"] == "bf16" and r["backend"] == BF16_BACKEND]
    if not plain:
        return None
    if mode == "eager":
        return plain[0]
    padded = [r for r in rows if r["_speed"] == "bf16" and r["backend"] == INDUCTOR_BF16_BACKEND]
    return min(plain[:1] + padded[:1], key=lambda r: r["median_ms"])


def _fused_options(options: list[Option], shape: SiteShape, kernels: KernelIndex) -> list[Option]:
    """The fused-norm variant of each rowwise dynamic forward option: the norm+quantize
    kernel replaces the bf16 norm and quantize(x), so the pass costs its GEMM plus the
    difference between the two norm kernels."""
    rows = kernels.get(BenchKey(shape.M_bucket, shape.K, 0, "fwd"), [])
    norm = [r for r in rows if r["backend"] == LAYER_NORM_BACKEND]
    fused = {r["_speed"]: r for r in rows if r["backend"] == NORM_QUANTIZE_BACKEND}
    if not norm:
        return []
    out = []
    for o in options:
        f = fused.get(speed_key(o.recipe))
        if f is None or not fusable(o.recipe):
            continue
        extra = f["median_ms"] - norm[0]["median_ms"]
        estimated = o.estimated or bool(f["estimated"]) or bool(norm[0]["estimated"])
        out.append(replace(o, median_ms=o.gemm_ms + extra, quant_ms=extra, fused=True,
                           estimated=estimated))  # fmt: skip
    return out


def _in_graph_options(
    options: list[Option], shape: SiteShape, kernels: KernelIndex, kind: str, pass_: str
) -> list[Option]:
    """`options` (of a forward, or a dgrad) with each traceable one whose recipe inductor
    fuses (`fuses_in_graph`) costed as a compiled graph runs it: its standalone quantization
    of x or dY (the `inductor.quantize` row) replaced by what quantizing costs fused into the
    op of `kind` that computes that operand (that op with the quantization, less the op
    alone). Options without those rows at this shape keep their standalone cost."""
    width = shape.K if pass_ == "fwd" else shape.N
    rows = kernels.get(BenchKey(shape.M_bucket, width, 0, pass_), [])
    alone = {r["_speed"]: r for r in rows if r["backend"] == QUANTIZE_BACKEND}
    fused = {r["_speed"]: r for r in rows if r["backend"] == producer_backend(kind, True)}
    op = [r for r in rows if r["backend"] == producer_backend(kind, False)]
    out = []
    for o in options:
        key = speed_key(o.recipe)
        if not (op and key in alone and key in fused and fuses_in_graph(o.recipe)
                and _traceable(o.backend)):  # fmt: skip
            out.append(o)
            continue
        quant = in_graph_quant_ms(
            o.quant_ms, alone[key]["median_ms"], op[0]["median_ms"], fused[key]["median_ms"]
        )
        estimated = o.estimated or any(
            bool(r["estimated"]) for r in (alone[key], fused[key], op[0])
        )
        out.append(replace(
            o, median_ms=o.gemm_ms + quant, quant_ms=quant, estimated=estimated, in_graph=kind,
            in_graph_saved_ms=o.median_ms - (o.gemm_ms + quant),
        ))  # fmt: skip
    return out


def _traceable(backend: str) -> bool | None:
    try:
        return registry.get(backend).traceable
    except KeyError:  # a table from a machine with other backends registered
        return None


def _mode_refusal(backend: str, mode: str) -> str | None:
    """Why `backend` does not run a pass of a model run in `mode` (None when it does)."""
    traceable = _traceable(backend)
    if traceable is None:
        return f"backend {backend!r} is not registered here"
    if mode != "eager" and not traceable:
        return (
            f"{mode} plan: only traceable backends run inside the compiled graph "
            "(custom-op kernels cost host time per call and break CUDA graphs)"
        )
    if mode == "eager" and traceable:
        return "eager plan: this backend's quantization is timed fused by torch.compile"
    return None


def _mode_runs(recipe: Recipe, shape: SiteShape, pass_: str, mode: str) -> bool:
    """Whether a registered FP8 backend that a `mode` plan may use runs `recipe` at this
    shape: if none does, its missing row is no budget matter (the plan summary counts only
    what more benchmarking could add)."""
    for backend in registry.backends("mm"):
        if backend.runs_bf16 or _mode_refusal(backend.name, mode) is not None:
            continue
        if backend.supports(recipe, shape.M_bucket, shape.K, shape.N, pass_) is None:
            return True
    return False


def _checked_verdict(err: dict, bound: float | None, budget: float) -> tuple[str, str]:
    """The row's verdict, checked against its numbers rather than believed: (verdict, what
    to add to the reason). A bound that is not a finite, non-negative number is INVALID; a
    "safe" row whose bound exceeds the budget, or an "undecided" one whose lower bound does,
    is unsafe."""
    if bound is None or not math.isfinite(bound) or bound < 0:
        return INVALID, f"error bound {bound} is not a finite number >= 0: refused"
    if not math.isfinite(budget):
        return INVALID, f"error budget {budget} is not a finite number: refused"
    verdict = err["verdict"]
    lower = err.get("lcb_rel_err")
    if verdict == SAFE and bound > budget:
        return "unsafe", " (labelled safe)"
    if verdict == UNDECIDED and lower is not None and not lower <= budget:
        return "unsafe", " (labelled undecided, lower bound over the budget too)"
    return verdict, ""


_PART_NOTES = {
    "varying": "to the part of the output that varies over the batch",
    "summed": "to the output's sum over the batch, which the gradients upstream are made of",
}


def _part_note(err: dict, budget: float) -> str:
    """Why a row whose balanced error is within budget is unsafe: the part of Probe's error
    that decided (`error_part`, from its `varying_rel_err` or `summed_rel_err`: what FP8
    adds to the output's token-to-token part, or to a dgrad output's sum over the tokens).
    Tables written before Probe measured a part have no such column: then nothing, or the
    varying error where only it was measured."""
    balanced = err.get("balanced_rel_err")
    part = err.get("error_part") or ("varying" if "error_part" not in err else None)
    value = err.get(f"{part}_rel_err") if part in _PART_NOTES else None
    if balanced is None or value is None or not balanced <= budget:
        return ""
    return (
        f" from its {part} error: FP8 adds {value:.3g} {_PART_NOTES[part]} (balanced error "
        f"{balanced:.3g}: within budget)"
    )


def site_candidates(
    site: dict,
    errors: dict[str, list[dict]],
    kernels: KernelIndex,
    config: PlanConfig,
) -> SiteChoice:
    """The candidates of every pass of `site` (a `sites` row), with each rejection's reason;
    `choice.note` says why the site cannot be evaluated at all (no shape, no bf16 timing)."""
    M = site["M_p50"]
    shape = SiteShape(m_bucket(M), site["K"], site["N"]) if M > 0 else None
    choice = SiteChoice(site["site"], site["K"], site["N"], M, site.get("time_share"), {}, {}, {})
    choice.norm = site.get("norm")
    choice.producer = site.get("producer")
    choice.grad_producer = site.get("grad_producer")
    for pass_ in PASSES:
        choice.options[pass_], choice.rejected[pass_] = [], []
        rows = kernels.get(BenchKey(*shape, pass_), []) if shape else []
        baseline = _bf16_baseline(rows, config.mode)
        if baseline is None:
            continue
        median, gemm, quant = _timing(baseline)
        choice.bf16[pass_] = Option(
            BF16_BACKEND, Recipe.parse("bf16"), pass_, median, gemm, quant,
            bool(baseline["estimated"]), None, None,
        )  # fmt: skip
        by_speed: dict[str, list[dict]] = {}
        for r in rows:
            if r["_speed"] != "bf16":
                by_speed.setdefault(r["_speed"], []).append(r)
                timing = _in_place(_timing(r, config.mode, config.charge_host), pass_, config)
                choice.best_gemm[pass_] = min(choice.best_gemm.get(pass_, gemm), timing.gemm_ms)
                choice.best_total[pass_] = min(
                    choice.best_total.get(pass_, median), timing.median_ms
                )
        probed = errors.get(pass_, [])
        probed_speeds = set()
        for err in probed:
            recipe = Recipe.parse(err["recipe"])
            key = speed_key(recipe)
            probed_speeds.add(key)
            timed = by_speed.get(key, [])
            if not timed:
                runs = _mode_runs(recipe, shape, pass_, config.mode)
                reason = (
                    "no kernel_bench row for this recipe at this shape"
                    if runs
                    else f"no backend a {config.mode} plan may use runs this recipe here"
                )
                choice.rejected[pass_].append(
                    {"backend": "*", "recipe": str(recipe), "reason": reason}
                )  # fmt: skip
                continue
            budget = err["budget"]
            if config.budgets and pass_ in config.budgets:
                budget = config.budgets[pass_]
            bound = err["ucb_rel_err"] if err["ucb_rel_err"] is not None else err["mean_rel_err"]
            verdict, why = _checked_verdict(err, bound, budget)
            if config.budgets and pass_ in config.budgets and verdict != INVALID:
                verdict, why = (SAFE if bound <= budget else "unsafe"), ""
            if (
                verdict == UNDECIDED and not config.allow_undecided
                and not config.excluded(site["site"], pass_)
                and not (config.inference and pass_ != "fwd")
            ):  # fmt: skip
                choice.undecided.append({**err, "budget": budget})
            for r in timed:
                timing = _timing(r, config.mode, config.charge_host)
                median, gemm, quant = _in_place(timing, pass_, config)
                option = Option(
                    r["backend"], recipe, pass_, median, gemm, quant, bool(r["estimated"]),
                    bound, budget,
                )  # fmt: skip
                reason = None
                if config.excluded(site["site"], pass_):
                    reason = "excluded by PlanConfig.exclude"
                elif config.inference and pass_ != "fwd":
                    reason = "inference plan: only the forward pass runs"
                elif verdict == INVALID:
                    reason = why
                elif verdict == "unsafe" and bound <= budget:  # a label stricter than its bound
                    reason = f"labelled unsafe (error bound {bound:.4g}, budget {budget:.4g})"
                elif verdict == "unsafe":
                    reason = (
                        f"unsafe: error bound {bound:.4g} > budget {budget:.4g}{why}"
                        f"{_part_note(err, budget)}"
                    )
                elif verdict == UNDECIDED and not config.allow_undecided:
                    reason = (
                        f"undecided after {err['n']} batch(es): error bound {bound:.4g} vs "
                        f"budget {budget:.4g}"
                    )
                elif not config.allow_estimated and (
                    r["estimated"] or choice.bf16[pass_].estimated
                ):
                    reason = (
                        "time ESTIMATED, not measured on this GPU (the bench budget ran out "
                        "first); measure it to consider FP8 here"
                    )
                elif r["backend"].endswith(".fast") and not config.allow_fast_accum:
                    reason = "fast accumulation not allowed (PlanConfig.allow_fast_accum)"
                else:
                    reason = _mode_refusal(r["backend"], config.mode)
                if reason is None:
                    choice.options[pass_].append(option)
                else:
                    choice.rejected[pass_].append(
                        {"backend": r["backend"], "recipe": str(recipe), "reason": reason}
                    )
        for key, timed in by_speed.items():
            if key not in probed_speeds:
                for r in timed:
                    choice.rejected[pass_].append(
                        {"backend": r["backend"], "recipe": r["recipe"],
                         "reason": "no error measurement (site_errors) for this recipe"}
                    )  # fmt: skip
    in_graph = shape is not None and config.mode != "eager" and config.fuse_into_producer
    for pass_, op in (("fwd", choice.producer), ("dgrad", choice.grad_producer)):
        kind = producer_kind(op)
        if in_graph and kind is not None:
            choice.options[pass_] = _in_graph_options(
                choice.options[pass_], shape, kernels, kind, pass_
            )
    fed = choice.norm is not None  # fed by a norm that feeds it alone (Probe traced it)
    if fed and shape is not None and choice.options["fwd"] and config.mode == "eager":
        choice.options["fwd"] += _fused_options(choice.options["fwd"], shape, kernels)
    if len(choice.bf16) < len(PASSES):
        choice.note = (
            "no site shape (M unknown)" if shape is None
            else f"no bf16 kernel_bench row at M~{shape.M_bucket}, K={shape.K}, N={shape.N}"
        )  # fmt: skip
    return choice
