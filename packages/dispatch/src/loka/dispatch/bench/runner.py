"""`benchmark`: the `kernel_bench` table for a set of GEMM shapes, measured on this GPU
(reusing the cache) or, without the target GPU, estimated from a recorded table."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import polars as pl
import torch

from loka.dispatch.bench.cache import BenchCache
from loka.dispatch.bench.candidates import (
    LAYER_NORM_BACKEND,
    NORM_QUANTIZE_BACKEND,
    PRODUCER_BACKENDS,
    PRODUCER_OPS,
    QUANTIZE_BACKEND,
    Candidate,
    CandidateStatus,
    candidates,
    fusable,
    fuses_in_graph,
    m_bucket,
    producer_backend,
    producer_kind,
    recipes_by_pass,
)
from loka.dispatch.bench.cost_model import CostModel
from loka.dispatch.bench.host import host_overhead_ms
from loka.dispatch.bench.timing import NativeQuantTimes, PassTimer, PassTiming
from loka.dispatch.device import DeviceInfo
from loka.kernels import available, registry
from loka.kernels.registry import gemm_dims
from loka.schema import empty, validate

Progress = Callable[[int, int, str], None]

# Share of the bench budget that may go to compiling and timing native quantizations; past
# it, operands not yet timed are fitted from the timed ones (`NativeQuantTimes`), so the
# rest of the budget measures GEMMs, a fraction of a second per candidate.
NATIVE_QUANT_BUDGET_SHARE = 0.4
# Shapes whose timers (inputs, quantization times) stay alive while the measuring order
# (`by_promise`) moves between shapes.
TIMERS_KEPT = 4
# A re-timed baseline this far from its cached time is reported in the bench's notes.
BASELINE_DRIFT = 0.05
# Rows that time no GEMM: norms and the ops computing a linear's input (N = 0).
NOT_GEMM_BACKENDS = frozenset({LAYER_NORM_BACKEND, NORM_QUANTIZE_BACKEND}) | PRODUCER_BACKENDS


@dataclass(frozen=True, order=True)
class Shape:
    """One GEMM site's shape as benchmarked: the M bucket, K and N."""

    M_bucket: int
    K: int
    N: int
    groups: int = 1


def site_shapes(sites: pl.DataFrame) -> list[Shape]:
    """The distinct shapes of the linear sites of a `sites` table, the most expensive first
    (by measured time share, else by flops), so that a budget cuts the least important."""
    linear = sites.filter((pl.col("kind") == "linear") & (pl.col("groups") == 1))
    linear = linear.filter(pl.col("M_p50") > 0)
    weight: dict[Shape, float] = {}
    for row in linear.iter_rows(named=True):
        shape = Shape(m_bucket(row["M_p50"]), row["K"], row["N"])
        share = row["time_share"]
        w = share if share is not None else 2.0 * row["M_p50"] * row["K"] * row["N"] * 1e-18
        weight[shape] = weight.get(shape, 0.0) + w
    return sorted(weight, key=lambda s: -weight[s])


def site_recipes(site_errors: pl.DataFrame) -> dict[str, list[str]]:
    """The recipes a `site_errors` table measured, per pass: the only FP8 recipes a plan
    can pick (it needs their error), so the only ones worth a bench's time. The default
    timing list has `e5m2:e4m3/row/dynamic` for the backward passes, which Probe's default
    recipes do not measure: timed for nothing, and with the bench ordered by promise
    (`by_promise`) it could take a pass's first slot."""
    out: dict[str, list[str]] = {}
    for row in site_errors.select("pass", "recipe").unique(maintain_order=True).iter_rows():
        out.setdefault(row[0], []).append(row[1])
    return out


def site_norm_shapes(sites: pl.DataFrame) -> list[tuple[int, int]]:
    """(M, K) of the norm feeding each linear site alone (`sites.norm`): the `norm_shapes` of
    `benchmark`, whose rows cost fusing such a norm into its linear."""
    fed = sites.filter(
        (pl.col("kind") == "linear") & (pl.col("groups") == 1) & (pl.col("M_p50") > 0)
        & pl.col("norm").is_not_null()
    )  # fmt: skip
    return [(row["M_p50"], row["K"]) for row in fed.iter_rows(named=True)]


def site_producer_shapes(sites: pl.DataFrame) -> list[tuple[int, int, str, str]]:
    """(M, width, kind, pass) of each op of a `PRODUCER_OPS` kind that computes a linear
    site's input (`sites.producer`; width K, pass fwd) or its output's gradient
    (`sites.grad_producer`; width N, pass dgrad): the `producer_shapes` of `benchmark`, whose
    rows cost a compiled graph's fusion of the pass's first quantization (x, dY) into that
    op. Tables written before schema version 3 have neither column: none."""
    out = []
    for column, width, pass_ in (("producer", "K", "fwd"), ("grad_producer", "N", "dgrad")):
        if column not in sites.columns:
            continue
        fed = sites.filter(
            (pl.col("kind") == "linear") & (pl.col("groups") == 1) & (pl.col("M_p50") > 0)
            & pl.col(column).is_not_null()
        )  # fmt: skip
        for row in fed.iter_rows(named=True):
            kind = producer_kind(row[column])
            if kind is not None:
                out.append((row["M_p50"], row[width], kind, pass_))
    return out


@dataclass
class BenchResult:
    """The kernel_bench rows for the shapes asked, and how each was obtained."""

    table: pl.DataFrame
    device: DeviceInfo  # the machine the times are for
    measured: int = 0
    reused: int = 0
    retimed: int = 0  # cached bf16 baselines timed again (`benchmark`'s retime_baselines)
    retimed_fp8: int = 0  # cached FP8 rows whose GEMM was timed again (the same switch)
    estimated: int = 0
    hopeless: int = 0  # eager candidates whose host time alone loses (`charge_host`)
    refused: list[tuple[Shape, Candidate, str]] = field(default_factory=list)
    failed: list[tuple[Shape, Candidate, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def is_estimate(self) -> bool:
        return self.estimated > 0


def _row(info: DeviceInfo, c: Candidate, shape: Shape, t: PassTiming, estimated: bool, source: str):
    m, k, n = gemm_dims(c.pass_, shape.M_bucket, shape.K, shape.N)
    return {
        **info.as_dict(), "backend": c.backend, "recipe": c.recipe, "pass": c.pass_,
        "M_bucket": shape.M_bucket, "K": shape.K, "N": shape.N, "groups": shape.groups,
        "median_ms": t.median_ms,
        "tflops": 2.0 * m * k * n * shape.groups / (t.median_ms * 1e-3) / 1e12 if t.median_ms > 0 else 0.0,
        "estimated": estimated, "gemm_ms": t.gemm_ms, "quant_ms": t.quant_ms,
        "method": t.method, "source": source,
    }  # fmt: skip


def _time(timer: PassTimer, c: Candidate) -> PassTiming:
    if c.backend == LAYER_NORM_BACKEND:
        t = timer.layer_norm_ms()
    elif c.backend == NORM_QUANTIZE_BACKEND:
        from loka.schema import Recipe

        t = timer.norm_quantize_ms(Recipe.parse(c.recipe))
    elif c.backend in PRODUCER_BACKENDS:
        t = timer.producer_ms(c)
    else:
        return timer.time(c)
    return PassTiming(t, t, 0.0, timer.method)


def _time_gemm(timer: PassTimer, c: Candidate) -> float:
    return timer.fp8_gemm_ms(c)


def _time_whole(timer: PassTimer, c: Candidate) -> float:
    return _time(timer, c).median_ms


def _retimed(
    row: dict,
    c: Candidate,
    timer_for: Callable[[], PassTimer],
    measure: Callable[[PassTimer, Candidate], float],
    drifts: list,
) -> dict:
    """`row` (a cached row) with its GEMM timed again by `measure` (`_time_whole` for a bf16
    baseline; `_time_gemm` for an FP8 row, its quantization time kept): itself when the
    cache was faster, else a copy with the new time. A failure to time keeps the cached row.

    Both sides of a pass's comparison are then this process's readings. With only the
    baselines re-timed, DHEN xl's cached FP8 GEMMs read 15% above its profiled step (6.96
    vs 6.05 ms) and the plan predicted 1.069x for a step measured at 1.142x."""
    try:
        gemm_ms = measure(timer_for(), c)
    except Exception:  # the cached measurement stands; the bench is not the place to fail
        return row
    cached = row["gemm_ms"] if row.get("gemm_ms") is not None else row["median_ms"]
    if cached > 0 and abs(gemm_ms / cached - 1.0) > BASELINE_DRIFT:
        drifts.append((row, cached, gemm_ms))
    if gemm_ms >= cached:
        return row
    median = gemm_ms + (row.get("quant_ms") or 0.0)
    m, k, n = gemm_dims(c.pass_, row["M_bucket"], row["K"], row["N"])
    tflops = 2.0 * m * k * n * row["groups"] / (median * 1e-3) / 1e12
    return {**row, "median_ms": median, "gemm_ms": gemm_ms, "tflops": tflops}


def _drift_note(
    drifts: list[tuple[dict, float, float]], retimed: int, what: str, faster_means: str
) -> str:
    """One line on the cached rows that re-timed more than BASELINE_DRIFT away."""
    faster = [d for d in drifts if d[2] < d[1]]
    note = (
        f"{len(drifts)} of {retimed} cached {what} re-timed more than {BASELINE_DRIFT:.0%} away "
        f"from the cache: {len(faster)} faster now (kept: {faster_means}), "
        f"{len(drifts) - len(faster)} slower (the cache's kept)"
    )
    if faster:
        row, cached, now = min(faster, key=lambda d: d[2] / d[1])
        note += (
            f"; the largest: {row['M_bucket']}x{row['K']}x{row['N']} {row['pass']} "
            f"{cached:.3f} ms cached, {now:.3f} ms now"
        )
    return note


def by_promise(
    plan: list[tuple[Shape, CandidateStatus]], cost_model: CostModel | None
) -> list[tuple[Shape, CandidateStatus]]:
    """The order to measure in, so that a budget cut leaves the least likely winners: first
    every bf16 row (each pass's baseline) and norm row; then, shape by shape (most important
    first), each pass's most promising FP8 candidate; then every shape's second, and so on.
    Promise is `cost_model`'s estimate, fastest first (candidates it cannot estimate after,
    in their given order). Shape-major order measured the first shapes' every candidate and
    left the later ones none: DHEN xl's eager bench measured 33 candidates of its first
    shapes in 60 s and estimated 271, which an eager plan may not use."""
    shape_rank = {shape: i for i, shape in enumerate(dict.fromkeys(s for s, _ in plan))}

    def estimate(shape: Shape, c: Candidate) -> float:
        t = cost_model.estimate(c, shape.M_bucket, shape.K, shape.N) if cost_model else None
        return math.inf if t is None else t.median_ms

    groups: dict[tuple[Shape, str], list[int]] = {}
    for i, (shape, status) in enumerate(plan):
        c = status.candidate
        if not (c.is_bf16 or c.backend in NOT_GEMM_BACKENDS):
            groups.setdefault((shape, c.pass_), []).append(i)
    tier = [0] * len(plan)
    for (shape, _), members in groups.items():
        ranked = sorted(members, key=lambda i: (estimate(shape, plan[i][1].candidate), i))
        for place, i in enumerate(ranked, start=1):
            tier[i] = place
    order = sorted(range(len(plan)), key=lambda i: (tier[i], shape_rank[plan[i][0]], i))
    return [plan[i] for i in order]


def timed_shape(shape: Shape, c: Candidate) -> Shape:
    """The shape `c` is timed at: `shape`, or for a backend whose linear pads its GEMMs
    (`Backend.linear_pads`: torch.native) its dims padded as that linear pads them, the
    operands it quantizes and multiplies (the row keeps the site's shape)."""
    if c.backend not in registry.names("mm"):
        return shape
    M, K, N = registry.get(c.backend).linear_dims(shape.M_bucket, shape.K, shape.N)
    return Shape(M, K, N, shape.groups)


def _host_ms(c: Candidate, shape: Shape, device: torch.device) -> float | None:
    """The pass's extra host time per step in eager mode (`host_overhead_ms`); None where
    it cannot be measured (the planner then charges none and says nothing more)."""
    if device.type != "cuda":
        return None
    try:
        return host_overhead_ms(c.backend, c.recipe, c.pass_, shape.K, shape.N, device)
    except Exception:  # a shape or recipe the module refuses: the GEMM row still stands
        return None


def _frame(rows: list[dict]) -> pl.DataFrame:
    return validate(pl.DataFrame(rows), "kernel_bench") if rows else empty("kernel_bench")


def mode_backends(mode: str) -> list[str]:
    """The GEMM backends a plan for `mode` may use: traceable ones (and bf16) for a compiled
    model, the others for an eager one (the planner's rule, `PlanConfig.mode`); `inductor.bf16`,
    the baseline as inductor pads an unaligned matmul, is a compiled model's only."""
    compiled = mode != "eager"
    return [
        b.name for b in registry.backends("mm")
        if b.traceable == compiled or (b.runs_bf16 and not b.traceable)
    ]  # fmt: skip


def can_measure(device: torch.device | str | None = None) -> bool:
    """True when FP8 GEMM backends can be timed on `device` (a GPU with FP8 tensor cores)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return False
    if device is None and not torch.cuda.is_available():
        return False
    return any(not registry.get(name).runs_bf16 for name in available(device, op="mm"))


def benchmark(
    shapes: Iterable[Shape],
    *,
    device: torch.device | str | None = None,
    recipes: Mapping[str, Iterable[str]] | None = None,
    cache: BenchCache | None = None,
    cost_model: CostModel | None = None,
    budget_s: float | None = None,
    include_fast_accum: bool = False,
    progress: Progress | None = None,
    time_on_cpu: bool = False,
    norm_shapes: Iterable[tuple[int, int]] = (),
    producer_shapes: Iterable[tuple[int, int, str, str]] = (),
    backends: Iterable[str] | None = None,
    retime_baselines: bool | None = None,
    charge_host: bool = False,
) -> BenchResult:
    """`kernel_bench` rows for every candidate (backend x recipe x pass) at each shape.

    On a GPU that can run FP8 backends, rows come from `cache` when present there, else are
    measured (`PassTimer`) and added to the cache; once `budget_s` is spent, the remaining
    rows are estimated by `cost_model` if it was recorded on the same GPU model, else left
    out (and said so in `notes`). Without such a GPU, every row is an estimate from
    `cost_model` (required then), for the device it was recorded on. `time_on_cpu` times
    on the CPU instead (Triton interpreter, wall clock): it checks the machinery, its
    numbers say nothing about GPU speed.

    `norm_shapes` are (M, K) of norms that feed a linear: for each, a bf16 LayerNorm row
    and a fused LayerNorm+quantize row per rowwise dynamic forward recipe (N = 0), which the
    planner uses to cost fusing the norm into the linear.

    `producer_shapes` are (M, width, kind, pass) of ops of a `PRODUCER_OPS` kind that
    compute a pass's first operand (`site_producer_shapes`: a forward's x[M, K], a dgrad's
    dY[M, N]): for each, at (M, width, N = 0) in that pass, the op alone compiled, the op
    fused with the quantization of its output per recipe of the pass inductor fuses, and
    that quantization alone, which the planner uses to cost a compiled pass's quantization
    of x or dY as inductor runs it. A dgrad's dY is computed by an op's backward; the
    forward op stands for it (the fusion adds an amax and a narrower write to either).

    `backends` limits the GEMM backends timed (e.g. `mode_backends("compiled")`: what a
    compiled plan may use), so that the budget goes to candidates the plan can pick.

    `charge_host`: the plan is an eager one that charges each FP8 pass its extra host time
    (`PlanConfig(mode="eager")`, `charge_host` on, the default there). A candidate whose
    host time alone is at least its pass's bf16 time at that shape cannot be picked, so it
    is neither timed nor estimated (`hopeless`, said in `notes`): DHEN large's eager bench
    spent its 60 s on 28 candidates and estimated 142, and every eager FP8 row measured on
    the H200 so far (312, host median 0.84 ms) is such a candidate.

    `retime_baselines` (default: on a GPU) times every cached bf16 GEMM row again (one
    CUDA graph each, a few seconds for a model) and keeps the faster of the two times. A
    bf16 row is the yardstick of every FP8 candidate at its shape, and a cache keeps one
    session's measurement for good: xl rows measured once on Dec 2 stood 16-29% slow
    against every later timing of the same GEMMs (`gemm_baseline_20261203T154910Z`), and
    each plan made from them overstated its saving. The faster time is kept because a slow
    reading (clocks, a neighbour) can overstate a baseline but nothing in the bench makes a
    GEMM read faster than it runs; a slow FP8 reading only makes a plan more careful.
    """
    shapes = list(dict.fromkeys(shapes))  # a shape asked twice is timed once
    fed = dict.fromkeys((m_bucket(m), w, kind, p) for m, w, kind, p in producer_shapes)
    for _, _, kind, pass_ in fed:
        if kind not in PRODUCER_OPS or pass_ not in ("fwd", "dgrad"):
            raise ValueError(
                f"producer shape: kind must be one of {sorted(PRODUCER_OPS)} and pass fwd or "
                f"dgrad, got {kind!r}, {pass_!r}"
            )
    measuring = time_on_cpu or can_measure(device)
    if time_on_cpu:
        device = torch.device("cpu")
        info = DeviceInfo.current(device)
    elif measuring:
        device = torch.device(device or "cuda")
        info = DeviceInfo.current(device)
    else:
        if cost_model is None:
            raise ValueError(
                "no GPU that can run FP8 kernels here and no cost model given: pass "
                "cost_model=CostModel.shipped() (or a recorded table) to estimate"
            )
        info = cost_model.device
    result = BenchResult(table=empty("kernel_bench"), device=info)
    if not measuring:
        result.notes.append(
            f"no FP8-capable GPU here: every time is an ESTIMATE for {info.device}, from "
            f"{cost_model.source}"
        )
    if retime_baselines is None:
        retime_baselines = measuring and not time_on_cpu
    cached = cache.load(info) if (measuring and cache is not None) else empty("kernel_bench")
    cached_keys = {
        (r["backend"], r["recipe"], r["pass"], r["M_bucket"], r["K"], r["N"], r["groups"]): r
        for r in cached.iter_rows(named=True)
    }
    model_fits_here = cost_model is not None and cost_model.device.device == info.device
    if measuring and cost_model is not None and not model_fits_here:
        result.notes.append(
            f"cost model {cost_model.source} was recorded on {cost_model.device.device}, not "
            f"{info.device}: not used for shapes past the budget"
        )
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    quant_deadline = (
        time.monotonic() + NATIVE_QUANT_BUDGET_SHARE * budget_s if budget_s is not None else None
    )
    native_quant = NativeQuantTimes()
    plan: list[tuple[Shape, CandidateStatus]] = []
    by_pass = recipes_by_pass(recipes)
    norm_recipes = [r for r in by_pass["fwd"] if fusable(r)]
    for M, K in dict.fromkeys((m_bucket(m), k) for m, k in norm_shapes):
        plan.append(
            (Shape(M, K, 0), CandidateStatus(Candidate(LAYER_NORM_BACKEND, "bf16", "fwd"), None))
        )
        for r in norm_recipes:
            c = Candidate(NORM_QUANTIZE_BACKEND, str(r), "fwd")
            plan.append((Shape(M, K, 0), CandidateStatus(c, None)))
    # Only measured: no cost model records them, and a plan without them costs the
    # quantization standalone.
    for M, width, kind, pass_ in fed if measuring else ():
        fusing = [str(r) for r in by_pass[pass_] if fuses_in_graph(r)]
        rows_here = [Candidate(producer_backend(kind, False), "bf16", pass_)]
        rows_here += [Candidate(producer_backend(kind, True), r, pass_) for r in fusing]
        rows_here += [Candidate(QUANTIZE_BACKEND, r, pass_) for r in fusing]
        plan += [(Shape(M, width, 0), CandidateStatus(c, None)) for c in rows_here]
    plan = list(dict.fromkeys(plan))  # one quantization row per (M, K) for both kinds
    for shape in shapes:
        for status in candidates(
            shape.M_bucket, shape.K, shape.N, recipes,
            device=device if measuring else None, include_fast_accum=include_fast_accum,
            runnable_only=time_on_cpu, backends=backends,
        ):  # fmt: skip
            plan.append((shape, status))
    plan = by_promise(plan, cost_model)
    rows, new_rows = [], []
    timers: dict[Shape, PassTimer] = {}
    # (cached row, cached ms, re-timed ms) beyond BASELINE_DRIFT: bf16 rows, FP8 rows' GEMMs
    drifts: list[tuple[dict, float, float]] = []
    fp8_drifts: list[tuple[dict, float, float]] = []
    rehosted: list[tuple[float, float]] = []  # (cached, re-measured) host ms of eager rows
    baseline_ms: dict[tuple[Shape, str], float] = {}  # the slowest bf16 row per shape, pass
    hopeless_host: list[float] = []
    over_budget = 0

    def keep(row: dict, shape: Shape, c: Candidate) -> None:
        rows.append(row)
        if c.is_bf16:
            key = (shape, c.pass_)
            baseline_ms[key] = max(baseline_ms.get(key, 0.0), row["median_ms"])

    for i, (shape, status) in enumerate(plan):
        c = status.candidate
        if progress is not None:
            progress(i, len(plan), f"{shape.M_bucket}x{shape.K}x{shape.N} {c.pass_} {c.backend}")
        if status.refusal is not None:
            result.refused.append((shape, c, status.refusal))
            continue
        key = (c.backend, c.recipe, c.pass_, shape.M_bucket, shape.K, shape.N, shape.groups)
        in_budget = measuring and (deadline is None or time.monotonic() < deadline)

        def timer_for(shape: Shape = shape, c: Candidate = c) -> PassTimer:
            timed = timed_shape(shape, c)
            timer = timers.pop(timed, None)
            if timer is None:
                timer = PassTimer(
                    timed.M_bucket, timed.K, timed.N, device, native_quant=native_quant
                )
            timers[timed] = timer  # the most recent last
            if len(timers) > TIMERS_KEPT:  # free the least recent shape's inputs
                del timers[next(iter(timers))]
            return timer

        if key in cached_keys:
            row = cached_keys[key]
            retime = retime_baselines and in_budget and c.backend in registry.names("mm")
            if retime and c.is_bf16:
                row = _retimed(row, c, timer_for, _time_whole, drifts)
                result.retimed += 1
            elif retime and row.get("gemm_ms") is not None:
                row = _retimed(row, c, timer_for, _time_gemm, fp8_drifts)
                result.retimed_fp8 += 1
            if row is not cached_keys[key]:
                new_rows.append(row)
            if retime and row.get("host_ms"):  # eager rows (traceable ones record 0)
                # The host's speed is this process's, and eager FP8 linears got cheaper on it
                # (CUDA graphs of their quantization): a cached host time is re-measured
                # (once per backend, speed key and pass, `host_overhead_ms`).
                host = _host_ms(c, shape, device)
                if host is not None:
                    rehosted.append((row["host_ms"], host))
                    row = {**row, "host_ms": host}
            keep(row, shape, c)
            result.reused += 1
            continue
        gemm = c.backend in registry.names("mm")
        if charge_host and measuring and gemm and not c.is_bf16 and (shape, c.pass_) in baseline_ms:
            # Its host time is measured once per backend, speed key and pass (cheap after).
            host = _host_ms(c, shape, device)
            if host is not None and host >= baseline_ms[(shape, c.pass_)]:
                result.hopeless += 1
                hopeless_host.append(host)
                continue
        if in_budget:
            native_quant.fit_only = quant_deadline is not None and time.monotonic() > quant_deadline
            timer = timer_for()
            try:
                t = _time(timer, c)
            except Exception as exc:  # a backend failing is a result, not a crash
                result.failed.append((shape, c, f"{type(exc).__name__}: {exc}"))
                continue
            row = _row(info, c, shape, t, False, "measured")
            if c.backend not in NOT_GEMM_BACKENDS:
                row["host_ms"] = _host_ms(c, shape, device)
            keep(row, shape, c)
            new_rows.append(row)
            result.measured += 1
            continue
        if measuring:
            over_budget += 1
        if cost_model is not None and (model_fits_here or not measuring):
            t = cost_model.estimate(c, shape.M_bucket, shape.K, shape.N)
            if t is not None:
                keep(_row(info, c, shape, t, True, cost_model.source), shape, c)
                result.estimated += 1
                continue
        result.failed.append((shape, c, "no measurement and no recorded time to estimate from"))
    if progress is not None:
        progress(len(plan), len(plan), "done")
    if over_budget:
        result.notes.append(
            f"{over_budget} candidate(s) past the {budget_s:.0f} s budget were not measured"
            + (" (estimated instead)" if model_fits_here else "")
        )
    if hopeless_host:
        result.notes.append(
            f"{result.hopeless} eager FP8 candidate(s) not timed: their host time alone "
            f"(median {statistics.median(hopeless_host):.3f} ms) is at least their pass's bf16 "
            "time, so a plan that charges host time cannot pick them"
        )
    if drifts:
        result.notes.append(_drift_note(drifts, result.retimed, "bf16 baseline(s)",
                                        "their FP8 candidates gain less than the cache said"))  # fmt: skip
    if fp8_drifts:
        result.notes.append(_drift_note(fp8_drifts, result.retimed_fp8, "FP8 GEMM(s)",
                                        "those candidates gain more than the cache said"))  # fmt: skip
    if rehosted:
        cached_ms, now_ms = (statistics.median(v) for v in zip(*rehosted, strict=True))
        result.notes.append(
            f"re-measured the host time of {len(rehosted)} cached eager FP8 row(s): median "
            f"{cached_ms:.3f} ms cached, {now_ms:.3f} ms now"
        )
    if new_rows and cache is not None:
        path = cache.store(info, _frame(new_rows))
        result.notes.append(f"cached {len(new_rows)} measured row(s) in {path}")
    result.table = _frame(rows)
    return result
