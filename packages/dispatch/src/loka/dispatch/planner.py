"""The planner: per GEMM site and pass, the fastest candidate whose error is safe.

Inputs are tables only (`sites`, `site_errors`, `kernel_bench`), so a plan can be made from
saved parquet files on a machine without Probe or a GPU.

Per site, at its median M (bucketed as in `kernel_bench`), K and N:
1. The candidates of a pass are the backends timed for each recipe Probe measured there
   (a recipe's timing is looked up by its speed key: formats, granularity, scaling kind).
   A candidate is eligible when its verdict is safe (or undecided, if allowed) and its
   accumulation mode is allowed; every other one is rejected with the reason.
2. The site's three passes are chosen together, because FP8 passes share quantizations:
   the forward's `quantize(x)` also yields the wgrad's x^T when both use the same x recipe
   (a transpose-quantization instead), and the dgrad's dY serves the wgrad's dY^T. Each
   `kernel_bench` row costs its pass standalone; a combination is credited the shared
   quantization time, booked to the wgrad. A combination is valid only if every FP8 pass,
   credits included, is faster than bf16 by `min_speedup`; the fastest valid one wins
   (bf16 everywhere is always valid).
3. Optionally, a global error budget: the sensitivity-weighted sum of the chosen passes'
   error bounds over all sites must stay within `error_budget_total`; while it does not,
   the site change that removes the most weighted error per millisecond lost is made.
The plan reports the predicted end-to-end speedup against its ceiling (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import polars as pl

from loka.dispatch.bench.cache import table_devices
from loka.dispatch.bench.candidates import (
    BF16_BACKEND,
    LAYER_NORM_BACKEND,
    NORM_QUANTIZE_BACKEND,
    fusable,
    m_bucket,
    speed_key,
)
from loka.kernels import registry
from loka.schema import PASSES, Recipe, empty, validate

SAFE, UNDECIDED = "safe", "undecided"
INVALID = "invalid"  # a site_errors row whose numbers cannot be checked (NaN, inf)
# How the model will run: eager, torch.compile, or torch.compile(mode="reduce-overhead").
MODES = ("eager", "compiled", "cudagraphs")


@dataclass(frozen=True)
class PlanConfig:
    """How the planner decides."""

    # Demand this speedup over bf16 from every FP8 pass. The default margin (5%) is above
    # the run-to-run noise of kernel medians and the cost model's typical error, so that a
    # pass is not switched to FP8 for a gain nobody could measure.
    min_speedup: float = 1.05
    # Fast-accumulation backends (".fast") accumulate a whole K in reduced precision; Probe's
    # errors do not cover that, so they are candidates only when allowed.
    allow_fast_accum: bool = False
    # Undecided verdicts (too few batches to be sure) are rejected unless allowed.
    allow_undecided: bool = False
    # Override the budget Probe judged against, per pass (None: use the table's).
    budgets: Mapping[str, float] | None = None
    # Sensitivity-weighted sum of error bounds over all FP8 passes that the plan may spend.
    error_budget_total: float | None = None
    # Weight of each site's error in that sum (glob pattern -> weight; default 1).
    sensitivity: Mapping[str, float] = field(default_factory=dict)
    # Site name patterns never planned for FP8.
    exclude: tuple[str, ...] = ()
    # Credit quantizations shared between passes (see the module documentation).
    share_quantization: bool = True
    # Plan for inference: only the forward pass counts (dgrad and wgrad stay bf16).
    inference: bool = False
    # FP8 candidates whose time is an estimate (the cost model's), not a measurement. None:
    # allowed only when the whole table is estimated (planning for a GPU that is absent);
    # on a table measured on the GPU, a shape left unmeasured (bench budget spent) stays
    # bf16, because estimates at skinny shapes can be far off (see the README).
    allow_estimated: bool | None = None
    # How the planned model runs ("eager", "compiled", "cudagraphs"). Compiled plans take
    # only traceable backends (`Backend.traceable`: quantization in torch ops, fused by
    # inductor, no Python per call, capturable as a CUDA graph); eager plans take the others,
    # since a traceable backend's quantization runs unfused (and is timed fused) in eager.
    mode: str = "eager"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not (math.isfinite(self.min_speedup) and self.min_speedup >= 1.0):
            raise ValueError(f"min_speedup must be >= 1, got {self.min_speedup}")
        if self.error_budget_total is not None and not self.error_budget_total >= 0:
            raise ValueError(f"error_budget_total must be >= 0, got {self.error_budget_total}")
        for pass_, value in (self.budgets or {}).items():
            if pass_ not in PASSES or not value > 0:
                raise ValueError(f"budgets: bad entry {pass_!r}: {value!r}")
        for pattern, weight in self.sensitivity.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"sensitivity[{pattern!r}] must be >= 0, got {weight}")

    def weight(self, site: str) -> float:
        value = 1.0
        for pattern, weight in self.sensitivity.items():
            if fnmatch.fnmatchcase(site, pattern):
                value = weight
        return value

    def excluded(self, site: str) -> bool:
        return any(fnmatch.fnmatchcase(site, p) for p in self.exclude)


@dataclass(frozen=True)
class _Option:
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

    @property
    def is_bf16(self) -> bool:
        return self.recipe.is_bf16

    @property
    def label(self) -> str:
        return f"{self.backend}+norm" if self.fused else self.backend


def _operand_quant(recipe: Recipe, fmt: str) -> tuple:
    return (fmt, recipe.granularity, recipe.scaling, recipe.history, recipe.pow2, recipe.scale_ub)


def _effective(combo: tuple[_Option, _Option, _Option], share: bool) -> tuple[float, ...]:
    """Per-pass times of a (fwd, dgrad, wgrad) combination, shared quantizations credited to
    the wgrad (never more than the wgrad's own quantization time)."""
    fwd, dgrad, wgrad = combo
    times = [fwd.median_ms, dgrad.median_ms, wgrad.median_ms]
    if share and not wgrad.is_bf16:
        credit = 0.0
        w = wgrad.recipe
        # A fused norm quantizes x rowwise per token only: no x^T to share.
        if (
            not fwd.is_bf16
            and not fwd.fused
            and _operand_quant(fwd.recipe, fwd.recipe.a_format) == _operand_quant(w, w.b_format)
        ):
            credit += fwd.quant_ms
        if not dgrad.is_bf16 and _operand_quant(
            dgrad.recipe, dgrad.recipe.a_format
        ) == _operand_quant(w, w.a_format):
            credit += dgrad.quant_ms
        times[2] -= min(credit, wgrad.quant_ms)
    return tuple(times)


@dataclass
class _SiteChoice:
    site: str
    K: int
    N: int
    M: int
    share: float | None
    bf16: dict[str, _Option]
    options: dict[str, list[_Option]]
    rejected: dict[str, list[dict]]
    combos: list[tuple[float, float, tuple, tuple[float, ...]]]  # (total, err, combo, eff)
    best_gemm: dict[str, float] = field(default_factory=dict)  # fastest FP8 GEMM, safe or not
    chosen: int = 0
    note: str | None = None  # why the site stays bf16 without any evaluation
    undecided: list[dict] = field(default_factory=list)  # site_errors rows refused as undecided

    def current(self):
        return self.combos[self.chosen]


@dataclass
class PlanSummary:
    """What the plan predicts, end to end (DESIGN.md, Principles)."""

    sites: int
    sites_fp8: int
    passes_fp8: int
    gemm_speedup: float  # bf16 GEMM time of the planned sites / planned time
    prequant_speedup: float  # s: pre-quantized FP8 GEMM speedup at these shapes (best backend)
    gemm_share: float | None  # g: share of step time in these GEMMs (sites.time_share)
    predicted_speedup: float | None  # 1 / ((1 - g) + sum_i g_i / s_i)
    ceiling: float | None  # 1 / ((1 - g) + g / s)
    estimated: bool
    device: str
    notes: list[str] = field(default_factory=list)
    # Measured on the real training step after apply (loka.dispatch.verify; None: not
    # verified): the kept FP8 sites' step speedup over bf16 with its interval, and every
    # site verification demoted, with the reason.
    measured_speedup: float | None = None
    measured_interval: list[float] | None = None  # [low, high] at measured_confidence
    measured_confidence: float | None = None
    measured_steps: int | None = None
    measured_method: str | None = None
    verified_sites: list[str] | None = None
    verify_demoted: dict[str, str] = field(default_factory=dict)
    verify_rounds: list[dict] = field(default_factory=list)
    # FP8 candidates refused only because their verdict was undecided, and about how many
    # sampled batches would decide them (`undecided_note`); None when there were none.
    undecided: str | None = None

    @property
    def share_of_ceiling(self) -> float | None:
        if self.predicted_speedup is None or self.ceiling is None or self.ceiling <= 1.0:
            return None
        return (self.predicted_speedup - 1.0) / (self.ceiling - 1.0)

    def lines(self) -> list[str]:
        est = " (ESTIMATED from a recorded table, not measured here)" if self.estimated else ""
        out = [
            f"device: {self.device}{est}",
            f"sites: {self.sites}, in FP8: {self.sites_fp8} sites / {self.passes_fp8} passes",
            f"GEMM time of the planned sites: {self.gemm_speedup:.2f}x bf16{est}",
            f"pre-quantized FP8 GEMM speedup at these shapes (s): {self.prequant_speedup:.2f}x",
        ]
        if self.gemm_share is None:
            out.append(
                "end-to-end: not predicted, the GEMM share of step time g is unknown "
                "(sites.time_share is measured on CUDA only)"
            )
        else:
            out.append(
                f"end-to-end: predicted {self.predicted_speedup:.3f}x, ceiling "
                f"1/((1-g)+g/s) = {self.ceiling:.3f}x with g = {self.gemm_share:.3f}{est}"
            )
        undecided = [self.undecided] if self.undecided else []
        return out + undecided + self.notes + self._measured_lines()

    def _measured_lines(self) -> list[str]:
        if self.measured_speedup is None:
            return []
        kept = len(self.verified_sites or [])
        total = kept + len(self.verify_demoted)
        if self.measured_interval is None:
            measured = "no FP8 site kept: the step runs bf16 (1.000x)"
        else:
            low, high = self.measured_interval
            measured = (
                f"{self.measured_speedup:.3f}x bf16 [{low:.3f}, {high:.3f}] "
                f"({self.measured_confidence:.0%} interval) with {kept} of {total} FP8 site(s)"
            )
        predicted = (
            f"; predicted {self.predicted_speedup:.3f}x"
            if self.predicted_speedup is not None else ""
        )  # fmt: skip
        out = [
            f"end-to-end: measured on the real step {measured}{predicted} "
            f"({self.measured_steps} steps, {self.measured_method})"
        ]
        return out + [f"demoted by verification: {s}: {r}" for s, r in self.verify_demoted.items()]


@dataclass
class Plan:
    """A `plan` table, what it predicts, and the metadata written with it."""

    table: pl.DataFrame
    summary: PlanSummary
    metadata: dict[str, str]

    def fp8_sites(self) -> list[str]:
        return (
            self.table.filter(pl.col("recipe") != "bf16")["site"]
            .unique(maintain_order=True)
            .to_list()
        )

    def write(self, path) -> object:
        from loka.schema import write_table

        return write_table(self.table, path, "plan", metadata=self.metadata)


def sites_fingerprint(sites: Iterable[tuple[str, int, int]]) -> str:
    """A hash of a model's linear sites (name, K, N): what a plan was made for."""
    items = sorted((str(s), int(k), int(n)) for s, k, n in sites)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def tables_fingerprint(sites: pl.DataFrame) -> str:
    """`sites_fingerprint` of a `sites` table's plannable sites (linear, one group): the
    model fingerprint a plan made from that table records."""
    linear = sites.filter((pl.col("kind") == "linear") & (pl.col("groups") == 1))
    return sites_fingerprint((r["site"], r["K"], r["N"]) for r in linear.iter_rows(named=True))


def _kernel_index(kernel_bench: pl.DataFrame) -> dict[tuple, list[dict]]:
    keyed = kernel_bench.filter(pl.col("groups") == 1).with_columns(
        pl.col("recipe").map_elements(speed_key, return_dtype=pl.String).alias("_speed")
    )
    index: dict[tuple, list[dict]] = {}
    for row in keyed.iter_rows(named=True):
        index.setdefault((row["M_bucket"], row["K"], row["N"], row["pass"]), []).append(row)
    return index


def _timing(row: dict, mode: str = "compiled") -> tuple[float, float, float]:
    """(median, GEMM, quantization) ms of a kernel_bench row; in an eager plan the pass's
    measured extra host time (`host_ms`, see `bench.host`) is charged to its median, since an
    eager step pays it unless the device is the slower side."""
    gemm = row.get("gemm_ms")
    quant = row.get("quant_ms")
    median = row["median_ms"]
    host = row.get("host_ms")
    if mode == "eager" and host is not None and math.isfinite(host):
        median += host
    return median, median if gemm is None else gemm, 0.0 if quant is None else quant


def _fused_options(options: list[_Option], shape: tuple, kernels: dict) -> list[_Option]:
    """The fused-norm variant of each rowwise dynamic forward option: the norm+quantize
    kernel replaces the bf16 norm and quantize(x), so the pass costs its GEMM plus the
    difference between the two norm kernels."""
    rows = kernels.get((shape[0], shape[1], 0, "fwd"), [])
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


def _site_options(
    site: dict,
    errors: dict[str, list[dict]],
    kernels: dict[tuple, list[dict]],
    config: PlanConfig,
    norm_fed: bool = False,
) -> _SiteChoice:
    M = site["M_p50"]
    shape = (m_bucket(M), site["K"], site["N"]) if M > 0 else None
    choice = _SiteChoice(
        site["site"], site["K"], site["N"], M, site.get("time_share"), {}, {}, {}, []
    )
    for pass_ in PASSES:
        choice.options[pass_], choice.rejected[pass_] = [], []
        rows = kernels.get((*shape, pass_), []) if shape else []
        bf16_rows = [r for r in rows if r["_speed"] == "bf16" and r["backend"] == BF16_BACKEND]
        if not bf16_rows:
            continue
        median, gemm, quant = _timing(bf16_rows[0])
        choice.bf16[pass_] = _Option(
            BF16_BACKEND, Recipe.parse("bf16"), pass_, median, gemm, quant,
            bool(bf16_rows[0]["estimated"]), None, None,
        )  # fmt: skip
        by_speed: dict[str, list[dict]] = {}
        for r in rows:
            if r["_speed"] != "bf16":
                by_speed.setdefault(r["_speed"], []).append(r)
                choice.best_gemm[pass_] = min(choice.best_gemm.get(pass_, gemm), _timing(r)[1])
        probed = errors.get(pass_, [])
        probed_speeds = set()
        for err in probed:
            recipe = Recipe.parse(err["recipe"])
            key = speed_key(recipe)
            probed_speeds.add(key)
            timed = by_speed.get(key, [])
            if not timed:
                choice.rejected[pass_].append(
                    {"backend": "*", "recipe": str(recipe),
                     "reason": "no kernel_bench row for this recipe at this shape"}
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
                and not config.excluded(site["site"]) and not (config.inference and pass_ != "fwd")
            ):  # fmt: skip
                choice.undecided.append({**err, "budget": budget})
            for r in timed:
                median, gemm, quant = _timing(r, config.mode)
                option = _Option(
                    r["backend"], recipe, pass_, median, gemm, quant, bool(r["estimated"]),
                    bound, budget,
                )  # fmt: skip
                reason = None
                if config.excluded(site["site"]):
                    reason = "site excluded by PlanConfig.exclude"
                elif config.inference and pass_ != "fwd":
                    reason = "inference plan: only the forward pass runs"
                elif verdict == INVALID:
                    reason = why
                elif verdict == "unsafe" and bound <= budget:  # a label stricter than its bound
                    reason = f"labelled unsafe (error bound {bound:.4g}, budget {budget:.4g})"
                elif verdict == "unsafe":
                    reason = f"unsafe: error bound {bound:.4g} > budget {budget:.4g}{why}"
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
    if norm_fed and shape is not None and choice.options["fwd"] and config.mode == "eager":
        choice.options["fwd"] += _fused_options(choice.options["fwd"], shape, kernels)
    if len(choice.bf16) < len(PASSES):
        choice.note = (
            "no site shape (M unknown)" if shape is None
            else f"no bf16 kernel_bench row at M~{shape[0]}, K={shape[1]}, N={shape[2]}"
        )  # fmt: skip
        return choice
    bf16 = tuple(choice.bf16[p] for p in PASSES)
    pools = [[choice.bf16[p], *choice.options[p]] for p in PASSES]
    # A traceable backend quantizes each operand in its own fused kernel: nothing is shared.
    share = config.share_quantization and config.mode == "eager"
    for combo in itertools.product(*pools):
        eff = _effective(combo, share)
        if any(
            not o.is_bf16 and t * config.min_speedup >= b.median_ms
            for o, t, b in zip(combo, eff, bf16, strict=True)
        ):
            continue
        err = sum(o.err for o in combo if not o.is_bf16)
        choice.combos.append((sum(eff), err, combo, eff))
    # Fastest first; among equal times the one with fewer FP8 passes, then less error.
    choice.combos.sort(key=lambda c: (round(c[0], 9), sum(not o.is_bf16 for o in c[2]), c[1]))
    return choice


def _spend_error_budget(choices: list[_SiteChoice], config: PlanConfig) -> list[str]:
    total = config.error_budget_total
    if total is None:
        return []
    weights = {c.site: config.weight(c.site) for c in choices}

    def spent() -> float:
        return sum(weights[c.site] * c.current()[1] for c in choices if c.combos)

    moves = 0
    while spent() > total + 1e-12:
        best = None
        for c in choices:
            if not c.combos:
                continue
            t0, e0 = c.current()[0], c.current()[1]
            for j, (t, e, _, _) in enumerate(c.combos):
                if e < e0 - 1e-15:
                    gain = weights[c.site] * (e0 - e) / max(t - t0, 1e-9)
                    if best is None or gain > best[0]:
                        best = (gain, c, j)
        if best is None:
            break
        best[1].chosen = best[2]
        moves += 1
    return [
        f"global error budget {total:.4g}: {moves} site change(s) made, "
        f"weighted error now {spent():.4g}"
    ]


def _rows(choice: _SiteChoice, config: PlanConfig) -> list[dict]:
    rows = []
    base = {"site": choice.site, "K": choice.K, "N": choice.N, "M_p50": choice.M}
    if choice.note is not None:
        for pass_ in PASSES:
            b = choice.bf16.get(pass_)
            rows.append(
                {
                    **base, "pass": pass_, "backend": BF16_BACKEND, "recipe": "bf16",
                    "bf16_ms": b.median_ms if b else math.nan,
                    "predicted_ms": b.median_ms if b else math.nan, "predicted_speedup": 1.0,
                    "predicted_rel_err": None, "budget": None,
                    "estimated": bool(b.estimated) if b else False,
                    "reason": f"stays bf16: {choice.note}",
                    "rejected": choice.rejected.get(pass_, []), "fuse_norm": False,
                }
            )  # fmt: skip
        return rows
    best_total = choice.combos[0][0]
    total, _, combo, eff = choice.current()
    budget_moved = not math.isclose(total, best_total)
    for i, pass_ in enumerate(PASSES):
        chosen, t, b = combo[i], eff[i], choice.bf16[pass_]
        rejected = list(choice.rejected[pass_])
        if not chosen.is_bf16:
            rejected.insert(0, {"backend": b.backend, "recipe": "bf16",
                                "reason": f"slower: {b.median_ms:.4g} ms vs {t:.4g} ms"})  # fmt: skip
        for o in choice.options[pass_]:
            if o is chosen:
                continue
            with_it = _best_with(o, choice, i)
            if math.isinf(with_it):
                what = (
                    "slower than bf16"
                    if o.median_ms >= b.median_ms
                    else f"not {config.min_speedup:g}x faster than bf16"
                )
                reason = (
                    f"{what}: {o.median_ms:.4g} ms vs {b.median_ms:.4g} ms "
                    "(also with quantizations shared)"
                )
            elif budget_moved and with_it < total:
                reason = "dropped to meet the global error budget"
            else:
                reason = (
                    f"loses in the site's joint choice of passes: site total with it "
                    f"{with_it:.4g} ms vs {total:.4g} ms chosen"
                )
            rejected.append({"backend": o.label, "recipe": str(o.recipe), "reason": reason})
        if chosen.is_bf16:
            if not choice.options[pass_]:
                reason = "bf16: no FP8 candidate is safe (and allowed) here"
            elif not any(not c[2][i].is_bf16 for c in choice.combos):
                reason = "bf16: no safe FP8 candidate is faster than bf16 here"
            elif budget_moved:
                reason = "bf16: FP8 dropped to meet the global error budget"
            else:
                reason = "bf16: the site is fastest with this pass in bf16"
        else:
            reason = (
                f"fastest safe choice: {b.median_ms / max(t, 1e-12):.2f}x bf16, error bound "
                f"{chosen.err:.4g} <= budget {chosen.budget:.4g}"
            )
            if t < chosen.median_ms - 1e-12:
                reason += f" (quantization shared with other passes: {chosen.median_ms - t:.4g} ms)"
            if chosen.fused:
                reason += (
                    f"; the norm feeding it is fused with the quantization "
                    f"({chosen.quant_ms:+.3g} ms against the bf16 norm)"
                )
            if budget_moved:
                reason += "; a slower, lower-error choice to meet the global error budget"
        rows.append(
            {
                **base, "pass": pass_, "backend": chosen.backend, "recipe": str(chosen.recipe),
                "bf16_ms": b.median_ms, "predicted_ms": t,
                "predicted_speedup": b.median_ms / max(t, 1e-12),
                "predicted_rel_err": None if chosen.is_bf16 else chosen.err,
                "budget": None if chosen.is_bf16 else chosen.budget,
                "estimated": bool(chosen.estimated or b.estimated), "reason": reason,
                "rejected": rejected, "fuse_norm": chosen.fused,
            }
        )  # fmt: skip
    return rows


def _best_with(option: _Option, choice: _SiteChoice, i: int) -> float:
    totals = [c[0] for c in choice.combos if c[2][i] is option]
    return min(totals) if totals else math.inf


def make_plan(
    sites: pl.DataFrame,
    site_errors: pl.DataFrame,
    kernel_bench: pl.DataFrame,
    config: PlanConfig | None = None,
    *,
    gemm_share: float | None = None,
    norm_fed: Iterable[str] = (),
) -> Plan:
    """Plan every linear site of `sites` from `site_errors` and `kernel_bench`.

    `gemm_share` overrides g (the share of step time in these GEMMs) when `sites` has no
    measured `time_share` (Probe measures it on CUDA only). `norm_fed` names the sites fed
    by a norm that feeds nothing else (`loka.dispatch.norm_fed_sites`): for them the plan
    also weighs fusing the norm with the forward's quantization (column `fuse_norm`),
    costed from the kernel_bench norm rows (N = 0).
    """
    config = config or PlanConfig()
    sites = validate(sites, "sites")
    site_errors = validate(site_errors, "site_errors")
    kernel_bench = validate(kernel_bench, "kernel_bench")
    devices = table_devices(kernel_bench)
    if len(devices) > 1:
        raise ValueError(
            "kernel_bench holds rows of several machines: "
            + "; ".join(d.describe() for d in devices)
            + ". Plan for one: filter the table by device first"
        )
    if gemm_share is not None and not 0 <= gemm_share <= 1:
        raise ValueError(f"gemm_share must be in [0, 1], got {gemm_share}")
    kernels = _kernel_index(kernel_bench)
    if config.allow_estimated is None:
        measured_here = bool((~kernel_bench["estimated"]).any())
        config = dataclasses.replace(config, allow_estimated=not measured_here)
    errors: dict[str, dict[str, list[dict]]] = {}
    for row in site_errors.iter_rows(named=True):
        errors.setdefault(row["site"], {}).setdefault(row["pass"], []).append(row)
    linear = sites.filter((pl.col("kind") == "linear") & (pl.col("groups") == 1))
    fed = set(norm_fed)
    choices = [
        _site_options(site, errors.get(site["site"], {}), kernels, config, site["site"] in fed)
        for site in linear.iter_rows(named=True)
    ]
    notes = _spend_error_budget(choices, config)
    skipped = sites.height - linear.height
    if skipped:
        notes.append(f"{skipped} grouped/bmm site(s) not planned (linear sites only)")
    rows = [r for c in choices for r in _rows(c, config)]
    if rows:
        table = validate(pl.DataFrame(rows, schema_overrides=_PLAN_TYPES), "plan")
    else:  # no linear site to plan: an empty plan, not a frame without columns
        notes.append("no linear site with a known shape: nothing to plan")
        table = empty("plan")
    passes = ("fwd",) if config.inference else PASSES
    summary = _summary(choices, table, devices, gemm_share, notes, passes)
    summary.undecided = undecided_note([e for c in choices for e in c.undecided])
    metadata = {
        "producer": "loka-dispatch planner",
        "model_fingerprint": tables_fingerprint(sites),
        "sites": json.dumps({r["site"]: [r["K"], r["N"]] for r in linear.iter_rows(named=True)}),
        "device": devices[0].describe() if devices else "none",
        "estimated": str(summary.estimated),
        "config": repr(config),
        "summary": json.dumps({k: v for k, v in summary.__dict__.items() if k != "notes"}),
    }
    return Plan(table, summary, metadata)


_PLAN_TYPES = {
    "predicted_rel_err": pl.Float64,
    "budget": pl.Float64,
    "rejected": pl.List(
        pl.Struct({"backend": pl.String, "recipe": pl.String, "reason": pl.String})
    ),
    "fuse_norm": pl.Boolean,
}


def batches_to_decide(err: dict) -> int | None:
    """About how many sampled batches would decide an undecided site_errors row: the n at
    which the Student-t half-width, with the standard deviation measured so far, leaves the
    mean on one side of the budget (normal quantile; at least the batches already seen + 1).
    None when too few batches were seen to have a standard deviation."""
    n, mean, std = err["n"], err["mean_rel_err"], err.get("std_rel_err")
    if std is None or n < 2 or not math.isfinite(std) or mean is None:
        return None
    gap = abs(err["budget"] - mean)
    if gap == 0:
        return None
    z = statistics.NormalDist().inv_cdf(err.get("confidence") or 0.95)
    return max(n + 1, math.ceil((z * std / gap) ** 2))


def undecided_note(rows: list[dict]) -> str | None:
    """One line on the FP8 candidates refused because their verdict was undecided: how many,
    after how many batches, and about how many sampled batches would decide most of them."""
    if not rows:
        return None
    seen = sorted({int(r["n"]) for r in rows})
    after = f"{seen[0]}" if len(seen) == 1 else f"{seen[0]}-{seen[-1]}"
    needs = sorted(x for r in rows if (x := batches_to_decide(r)) is not None)
    text = (
        f"{len(rows)} FP8 candidate(s) refused as undecided after {after} sampled batch(es) "
        "(their error bounds straddle the budget)"
    )
    if needs:
        most = needs[min(len(needs) - 1, (3 * len(needs)) // 4)]
        text += (
            f"; about {most} sampled batches would decide most of them (median {needs[len(needs) // 2]}): "
            "probe longer, e.g. more warm-up steps"
        )
    else:
        text += "; too few batches to estimate how many would decide them: probe longer"
    return text


_UNMEASURED = ("time ESTIMATED, not measured", "no kernel_bench row")


def _unmeasured_sites(choices: list[_SiteChoice]) -> list[str]:
    """Sites (largest time share first) with a candidate refused only for lack of a
    measurement: what a larger bench budget could still turn to FP8."""
    found = [
        c for c in choices
        if any(r["reason"].startswith(_UNMEASURED) for rows in c.rejected.values() for r in rows)
    ]  # fmt: skip
    found.sort(key=lambda c: -(c.share or 0.0))
    return [c.site for c in found]


def _summary(choices, table, devices, gemm_share, notes, passes) -> PlanSummary:
    timed = [c for c in choices if c.note is None]
    index = [PASSES.index(p) for p in passes]

    def planned(c: _SiteChoice) -> float:
        return sum(c.current()[3][i] for i in index)

    def bf16(c: _SiteChoice) -> float:
        return sum(c.bf16[p].median_ms for p in passes)

    bf16_total = sum(bf16(c) for c in timed)
    plan_total = sum(planned(c) for c in timed)
    # s is about the hardware: the best pre-quantized GEMM among all timed FP8 candidates,
    # safe or not, against bf16.
    prequant_total = sum(
        min(c.best_gemm.get(p, math.inf), c.bf16[p].gemm_ms) for c in timed for p in passes
    )
    s_prequant = bf16_total / prequant_total if prequant_total > 0 else 1.0
    shares = [c.share for c in timed]
    g = None
    predicted = ceiling = None
    # sites.time_share is a share of the training step: it says nothing of inference.
    if timed and passes == PASSES and all(s is not None for s in shares):
        g = float(sum(shares))
        predicted = 1.0 / ((1.0 - g) + sum(c.share * planned(c) / bf16(c) for c in timed))
    elif gemm_share is not None:
        g = gemm_share
        predicted = 1.0 / ((1.0 - g) + g * plan_total / bf16_total) if bf16_total > 0 else None
        notes = [*notes, f"g = {g:.3f} given, not measured"]
    if g is not None:
        ceiling = 1.0 / ((1.0 - g) + g / s_prequant)
    unmeasured = _unmeasured_sites(choices)
    if unmeasured:
        shown = ", ".join(unmeasured[:5]) + (
            f" and {len(unmeasured) - 5} more" if len(unmeasured) > 5 else ""
        )
        notes = [*notes, f"{len(unmeasured)} site(s) have FP8 candidates the bench left "
                 f"unmeasured (budget spent or no row), so they were not considered: {shown}"]  # fmt: skip
    fp8 = table.filter(pl.col("recipe") != "bf16")
    # ESTIMATED when an FP8 choice rests on an estimate, or nothing was measured at all; a
    # measured plan whose bf16-only sites have estimated baselines says so in a note.
    estimated = bool(fp8["estimated"].any()) or not bool((~table["estimated"]).any())
    if not estimated and table["estimated"].any():
        notes = [*notes, f"{int(table['estimated'].sum())} of {table.height} bf16 baseline "
                 "time(s) are estimates (shapes not measured within the bench budget)"]  # fmt: skip
    return PlanSummary(
        sites=len(choices),
        sites_fp8=fp8["site"].n_unique(),
        passes_fp8=fp8.height,
        gemm_speedup=bf16_total / plan_total if plan_total > 0 else 1.0,
        prequant_speedup=s_prequant,
        gemm_share=g,
        predicted_speedup=predicted,
        ceiling=ceiling,
        estimated=estimated,
        device=devices[0].device if devices else "none",
        notes=[*list(notes), f"{len(choices) - len(timed)} site(s) without timings stay bf16"]
        if len(timed) < len(choices) else list(notes),
    )  # fmt: skip
