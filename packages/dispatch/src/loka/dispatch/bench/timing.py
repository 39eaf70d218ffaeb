"""Timing one pass of a linear as an FP8 linear runs it: operand quantization plus the GEMM.

Per pass (kernels/README.md, "The passes of a linear"), with the weight's FP8 copies made
once per optimizer step and therefore not timed:

| pass  | quantization timed            | GEMM (NT)                 |
| ----- | ----------------------------- | ------------------------- |
| fwd   | quantize(x)                   | x[M,K] @ W[N,K]^T         |
| dgrad | quantize(dY)                  | dY[M,N] @ (W^T)[K,N]^T    |
| wgrad | quantize_transpose(dY) and    | (dY^T)[N,M] @ (x^T)[K,M]^T|
|       | quantize_transpose(x)         |                           |

A traceable backend (`torch.native`) keeps no weight copies: its fwd and dgrad also
quantize the weight (from its float32 master copy) every step, and its quantizations are
timed as `torch.compile` makes them (one fused kernel per operand), since that is the only
mode the planner uses it in. Each of those is its own compiled graph (about a second of
compilation for a few microseconds of work), so they are timed per operand and shared
(`NativeQuantTimes`): keyed by the operand's shape, dtype, granularity and layout, not its
FP8 format (e4m3 and e5m2 move the same bytes); once the bench hands its remaining budget
to GEMMs (`fit_only`), an operand not yet timed is estimated by a least-squares line
(time = a + b * bytes) through the measured operands of the same granularity and layout,
and the row's method says so (`+quant_fit`).

Each pass is costed standalone; the planner credits the quantizations two FP8 passes share
(the forward's x with the wgrad's x^T, the dgrad's dY with the wgrad's dY^T). Every part is
timed separately (a quantization does not depend on the GEMM backend that consumes it), as
the median over replays of a CUDA graph holding many calls that rotate over several copies
of the inputs, so that neither launch overhead nor a warm L2 cache flatters small shapes.
On the CPU the same calls are timed with a wall clock: that checks the machinery, not speed.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loka.dispatch.bench.candidates import (
    PRODUCER_OPS,
    PRODUCER_ROWS,
    QUANTIZE_BACKEND,
    Candidate,
)
from loka.kernels import fp8_mm, norm_quantize, quantize, quantize_transpose, registry
from loka.kernels.registry import gemm_dims
from loka.schema import Recipe

# Rotate over enough input copies that one set no longer fits in the H200's 50 MB L2.
ROTATE_BYTES = 128 * 2**20
MAX_COPIES = 8
ACT_BLOCK, WEIGHT_BLOCK = (1, 128), (128, 128)


@dataclass(frozen=True)
class PassTiming:
    median_ms: float  # quant_ms + gemm_ms
    gemm_ms: float
    quant_ms: float
    method: str  # "cuda_graph", "eager" (graph capture failed) or "wall_clock" (CPU)


@dataclass(frozen=True)
class QuantOperand:
    """What decides the time of one compiled native quantization."""

    rows: int
    cols: int
    element_bytes: int
    granularity: str
    transpose: bool
    # a recipe's center: the token mean taken out first and its product with the weight
    # taken (`loka.mods.native_function.NativePass.centered`)
    centered: bool = False

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * self.element_bytes


class NativeQuantTimes:
    """Compiled native quantization times per operand, shared by every shape's `PassTimer`
    in one bench: measured, or with `fit_only` fitted from the measured ones."""

    def __init__(self) -> None:
        self.measured: dict[QuantOperand, float] = {}
        self.fit_only = False

    def time(self, operand: QuantOperand, measure: Callable[[], float]) -> tuple[float, bool]:
        """(milliseconds, whether fitted rather than measured)."""
        if operand in self.measured:
            return self.measured[operand], False
        if self.fit_only:
            fitted = self.fit(operand)
            if fitted is not None:
                return fitted, True
        ms = self.measured[operand] = measure()
        return ms, False

    def fit(self, operand: QuantOperand) -> float | None:
        """`a + b * bytes` from the measured operands of the same granularity and layout
        (a and b kept non-negative); None with fewer than two of them."""
        points = [
            (o.bytes, ms)
            for o, ms in self.measured.items()
            if (o.granularity, o.transpose, o.centered)
            == (operand.granularity, operand.transpose, operand.centered)
        ]
        if len({b for b, _ in points}) < 2:
            return None
        n = len(points)
        mean_x = sum(b for b, _ in points) / n
        mean_y = sum(ms for _, ms in points) / n
        var = sum((b - mean_x) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_x) * (ms - mean_y) for b, ms in points) / var)
        intercept = max(0.0, mean_y - slope * mean_x)
        return intercept + slope * operand.bytes


def _median_cuda_graph(fn: Callable[[], object], target_ms: float, replays: int) -> float:
    for _ in range(3):  # compile and autotune outside the capture
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(2000, int(target_ms / max(start.elapsed_time(end) / 5, 1e-4))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured on torch's side stream, replayed on this one
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _median_eager(fn: Callable[[], object], target_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, rep=max(int(target_ms), 5), return_mode="median"))


def _median_wall(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _static_graphs(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """`fn` under torch.compile, one static graph per shape and layout: a dynamic-shape
    graph serves every shape but its reductions ran 3-8x slower on the H200 (tensorwise amax
    1.1-1.5 ms instead of ~0.1 ms at 16384 x 4096), which is not what a compiled model
    (static shapes) runs."""
    compiled = torch.compile(fn, dynamic=False)

    def run(*args, **kwargs):
        # Every (shape, format, granularity, layout) is its own graph: more than dynamo's
        # default of 8 per function, so lift the limit for these calls only.
        with torch._dynamo.config.patch(recompile_limit=1024):
            return compiled(*args, **kwargs)

    return run


@functools.cache
def _compiled_native_quantize() -> Callable[..., tuple]:
    """`quantize_native`, compiled (`_static_graphs`)."""
    from loka.kernels.native import quantize_native

    return _static_graphs(quantize_native)


def centered_quantize(
    t: torch.Tensor, other: torch.Tensor, fmt: str, granularity: str
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A centering pass's first operand as the native linear prepares it (the work of
    loka.mods' `NativePass.centered`, private to loka.mods): the token mean taken out, what
    is left quantized, and the mean's product with `other` (the GEMV whose result the GEMM
    adds as its bias)."""
    from loka.kernels.native import quantize_native

    t = t.float()
    mean = t.mean(dim=0, keepdim=True)
    return quantize_native(t - mean, fmt, granularity), mean @ other.float()


@functools.cache
def _compiled_native_centered_quantize() -> Callable[..., tuple]:
    """`centered_quantize`, compiled (`_static_graphs`)."""
    return _static_graphs(centered_quantize)


def run_producer(
    kind: str, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The op standing for a `PRODUCER_OPS` class: GELU for pointwise ops, LayerNorm (over
    the last dim, with `weight` and `bias`) for norms."""
    if kind == "norm":
        return F.layer_norm(t, (t.shape[-1],), weight, bias)
    if kind == "pointwise":
        return F.gelu(t)
    raise ValueError(f"producer kind must be one of {sorted(PRODUCER_OPS)}, got {kind!r}")


def producer_then_quantize(
    kind: str,
    t: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    fmt: str,
    granularity: str,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A producer's output quantized as the next linear's x, the output kept too (a training
    step saves it for the bf16 wgrad): compiled, inductor fuses both into the op's kernel."""
    from loka.kernels.native import quantize_native

    y = run_producer(kind, t, weight, bias)
    return y, quantize_native(y, fmt, granularity)


@functools.cache
def _compiled_producer(quantized: bool) -> Callable[..., object]:
    """`run_producer` or `producer_then_quantize`, compiled (`_static_graphs`)."""
    return _static_graphs(producer_then_quantize if quantized else run_producer)


class _Rotation:
    """Several copies of a pass's inputs, handed out in turn."""

    def __init__(self, makers: list[Callable[[], object]], bytes_per_copy: int) -> None:
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(bytes_per_copy, 1))))
        self.items = [[make() for make in makers] for _ in range(copies)]
        self.i = 0

    def next(self) -> list:
        item = self.items[self.i]
        self.i = (self.i + 1) % len(self.items)
        return item


class PassTimer:
    """Times candidates at one shape, measuring each distinct quantization once."""

    def __init__(
        self,
        M: int,
        K: int,
        N: int,
        device: torch.device | str,
        *,
        target_ms: float = 4.0,
        replays: int = 7,
        seed: int = 0,
        native_quant: NativeQuantTimes | None = None,
    ) -> None:
        self.M, self.K, self.N = M, K, N
        self.native_quant = native_quant if native_quant is not None else NativeQuantTimes()
        self._fitted: set[tuple] = set()
        self.device = torch.device(device)
        self.target_ms, self.replays = target_ms, replays
        self.method = "cuda_graph" if self.device.type == "cuda" else "wall_clock"
        g = torch.Generator(device=self.device).manual_seed(seed)

        def rand(*shape: int) -> Callable[[], torch.Tensor]:
            return lambda: torch.randn(
                *shape, generator=g, device=self.device, dtype=torch.float32
            ).to(torch.bfloat16)

        self.w = rand(N, K)()
        self._x = _Rotation([rand(M, K)], 2 * M * K)
        self._dy = _Rotation([rand(M, N)], 2 * M * N)
        self._quant_ms: dict[tuple, float] = {}
        self._weights: dict[tuple, object] = {}

    # -- measuring ------------------------------------------------------------------

    def _measure(self, fn: Callable[[], object]) -> float:
        if self.method == "wall_clock":
            return _median_wall(fn)
        if self.method == "cuda_graph":
            try:
                return _median_cuda_graph(fn, self.target_ms, self.replays)
            except RuntimeError:
                # Something in the path synchronizes or allocates in a way capture refuses:
                # time it eagerly and say so in the row.
                torch.cuda.synchronize()
                self.method = "eager"
        return _median_eager(fn, self.target_ms)

    # -- operands -------------------------------------------------------------------

    def _weight(self, recipe: Recipe, pass_: str) -> object:
        """The cached FP8 weight operand of fwd (W) or dgrad (W^T)."""
        key = (recipe.b_format, recipe.granularity, pass_)
        if key not in self._weights:
            block = WEIGHT_BLOCK if recipe.granularity == "block" else None
            if pass_ == "fwd":
                w = quantize(self.w, recipe.b_format, recipe.granularity, block=block)
            else:
                w = quantize_transpose(self.w, recipe.b_format, recipe.granularity, block=block)[1]
            self._weights[key] = w
        return self._weights[key]

    def _quantizer(self, recipe: Recipe, pass_: str) -> Callable[[], tuple]:
        """A call that quantizes the pass's non-weight operands from the next input copy."""
        block = ACT_BLOCK if recipe.granularity == "block" else None
        gran = recipe.granularity
        # Delayed scaling takes its scale from a recorded amax: no amax pass is timed.
        delayed = recipe.scaling == "delayed"
        amax_x = self._amax(self._x) if delayed else None
        amax_dy = self._amax(self._dy) if delayed else None
        if pass_ == "fwd":
            return lambda: (
                quantize(self._x.next()[0], recipe.a_format, gran, block=block, amax=amax_x),
            )
        if pass_ == "dgrad":
            return lambda: (
                quantize(self._dy.next()[0], recipe.a_format, gran, block=block, amax=amax_dy),
            )

        def wgrad() -> tuple:
            dyt = quantize_transpose(self._dy.next()[0], recipe.a_format, gran, block=block,
                                     amax=amax_dy)[1]  # fmt: skip
            xt = quantize_transpose(self._x.next()[0], recipe.b_format, gran, block=block,
                                    amax=amax_x)[1]  # fmt: skip
            return dyt, xt

        return wgrad

    @staticmethod
    def _amax(rotation: _Rotation) -> torch.Tensor:
        return rotation.items[0][0].abs().amax().float().view(1)

    def _bf16_operands(self, pass_: str) -> Callable[[], tuple]:
        if pass_ == "fwd":
            return lambda: (self._x.next()[0], self.w)
        if pass_ == "dgrad":
            return lambda: (self._dy.next()[0], self.w.t())
        return lambda: (self._dy.next()[0].t(), self._x.next()[0].t())

    # -- public ---------------------------------------------------------------------

    @staticmethod
    def _quant_key(recipe: Recipe, pass_: str, traceable: bool) -> tuple:
        return (pass_, recipe.a_format, recipe.b_format, recipe.granularity, recipe.scaling,
                traceable, recipe.center)  # fmt: skip

    def quant_ms(self, recipe: Recipe, pass_: str, traceable: bool = False) -> float:
        key = self._quant_key(recipe, pass_, traceable)
        if key not in self._quant_ms:
            if traceable:
                self._quant_ms[key] = self._native_quant_ms(recipe, pass_, key)
            else:
                self._quant_ms[key] = self._measure(self._quantizer(recipe, pass_))
        return self._quant_ms[key]

    def _native_operands(self, recipe: Recipe, pass_: str) -> list[tuple]:
        """(inputs rotation or fixed tensor, format, transpose) of each operand the
        traceable backend quantizes in `pass_` (the weight from its float32 master)."""
        if not hasattr(self, "_master_w"):
            self._master_w = self.w.float()
        a, b, w = recipe.a_format, recipe.b_format, self._master_w
        return {
            "fwd": [(self._x, a, False), (w, b, False)],
            "dgrad": [(self._dy, a, False), (w, b, True)],
            "wgrad": [(self._dy, a, True), (self._x, b, True)],
        }[pass_]

    def _native_quant_ms(self, recipe: Recipe, pass_: str, key: tuple) -> float:
        """The pass's quantizations as the traceable backend runs them, compiled, summed
        over its operands (each measured once per bench, or fitted: `NativeQuantTimes`)."""
        quant = _compiled_native_quantize()
        total = 0.0
        for i, (source, fmt, transpose) in enumerate(self._native_operands(recipe, pass_)):
            sample = source if isinstance(source, torch.Tensor) else source.items[0][0]
            centered = recipe.center and i == 0  # fwd's x, dgrad's dY
            operand = QuantOperand(*sample.shape, sample.element_size(), recipe.granularity,
                                   transpose, centered)  # fmt: skip

            def get(source=source) -> torch.Tensor:
                return source if isinstance(source, torch.Tensor) else source.next()[0]

            if centered:
                # with the product of the mean [1, C] with the weight as [C, width]
                other = self._master_w.t() if pass_ == "fwd" else self._master_w
                center = _compiled_native_centered_quantize()

                def run(get=get, fmt=fmt, other=other, center=center):
                    return center(get(), other, fmt, recipe.granularity)
            else:
                # The static graph's form: a jagged site (Fp8LinearConfig.tokens_vary) runs
                # its two-stage amax with M symbolic at about the static one-stage speed
                # (0.199 vs 0.159 ms, 0.526 vs 0.517 ms;
                # bench/results/native_dynamic_20261202T170340Z).
                def run(get=get, fmt=fmt, transpose=transpose):
                    return quant(get(), fmt, recipe.granularity, transpose=transpose)

            ms, fitted = self.native_quant.time(operand, lambda run=run: self._measure(run))
            total += ms
            if fitted:
                self._fitted.add(key)
        return total

    def layer_norm_ms(self) -> float:
        """A bf16 LayerNorm of x[M, K] (its output kept for the backward, as autograd does)."""
        ln_w, ln_b = self._norm_params()
        return self._measure(lambda: F.layer_norm(self._x.next()[0], (self.K,), ln_w, ln_b))

    def norm_quantize_ms(self, recipe: Recipe) -> float:
        """LayerNorm fused with the rowwise quantization of its output (`norm_quantize`),
        writing the normed bf16 output too (the backward needs it): what a fused norm+linear
        runs in place of the LayerNorm and the forward's quantize(x)."""
        ln_w, ln_b = self._norm_params()
        return self._measure(
            lambda: norm_quantize(self._x.next()[0], ln_w, ln_b, fmt=recipe.a_format,
                                  pow2=recipe.pow2, return_normed=True)
        )  # fmt: skip

    def producer_ms(self, candidate: Candidate) -> float:
        """A producer row (`PRODUCER_BACKENDS`) at [M, K] (a forward's x, or a dgrad's dY
        with this timer's K its N), compiled as a model's graph runs it: the op alone, the
        op fused with quantizing its output, or the standalone quantization of the operand
        that the fusion replaces."""
        recipe = Recipe.parse(candidate.recipe)
        x = self._x
        if candidate.backend == QUANTIZE_BACKEND:
            quant = _compiled_native_quantize()
            return self._measure(lambda: quant(x.next()[0], recipe.a_format, recipe.granularity))
        if candidate.backend not in PRODUCER_ROWS:
            raise ValueError(f"not a producer row's backend: {candidate.backend!r}")
        kind, quantized = PRODUCER_ROWS[candidate.backend]
        w, b = self._norm_params()
        run = _compiled_producer(quantized)
        if not quantized:
            return self._measure(lambda: run(kind, x.next()[0], w, b))
        fmt, gran = recipe.a_format, recipe.granularity
        return self._measure(lambda: run(kind, x.next()[0], w, b, fmt, gran))

    def _norm_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "_ln"):
            self._ln = (torch.ones(self.K, device=self.device, dtype=torch.bfloat16),
                        torch.zeros(self.K, device=self.device, dtype=torch.bfloat16))  # fmt: skip
        return self._ln

    def output(self, candidate: Candidate) -> torch.Tensor:
        """The pass's GEMM result on the first input copy, computed as `time` times it (for
        checking that the benchmark computes the right product)."""
        backend = registry.get(candidate.backend)
        recipe = Recipe.parse(candidate.recipe)
        self._x.i = self._dy.i = 0
        if recipe.is_bf16:
            return backend.run(*self._bf16_operands(candidate.pass_)())
        operands = self._quantizer(recipe, candidate.pass_)()
        if candidate.pass_ != "wgrad":
            operands = (operands[0], self._weight(recipe, candidate.pass_))
        return fp8_mm(*operands, backend=backend)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, W, dY) of the first input copy."""
        return self._x.items[0][0], self.w, self._dy.items[0][0]

    def time(self, candidate: Candidate) -> PassTiming:
        """Time `candidate` at this shape (raises whatever the backend raises)."""
        backend = registry.get(candidate.backend)
        recipe = Recipe.parse(candidate.recipe)
        pass_ = candidate.pass_
        if recipe.is_bf16:
            operands = self._bf16_operands(pass_)
            gemm_ms = self._measure(lambda: backend.run(*operands()))
            return PassTiming(gemm_ms, gemm_ms, 0.0, self.method)
        gemm_ms = self.fp8_gemm_ms(candidate)
        quant_ms = self.quant_ms(recipe, pass_, backend.traceable)
        fitted = self._quant_key(recipe, pass_, backend.traceable) in self._fitted
        method = self.method + ("+quant_fit" if fitted else "")
        return PassTiming(gemm_ms + quant_ms, gemm_ms, quant_ms, method)

    def fp8_gemm_ms(self, candidate: Candidate) -> float:
        """The FP8 GEMM of `candidate` alone, on operands quantized beforehand (what the
        bench re-times of a cached FP8 row: its quantization, compiled per operand for a
        traceable backend, is not timed again)."""
        backend = registry.get(candidate.backend)
        recipe = Recipe.parse(candidate.recipe)
        pass_ = candidate.pass_
        quantizer = self._quantizer(recipe, pass_)
        if pass_ == "wgrad":
            a, b = quantizer()
            pairs = [(a, b)] + [quantizer() for _ in range(len(self._x.items) - 1)]
        else:
            w = self._weight(recipe, pass_)
            pairs = [(quantizer()[0], w) for _ in range(len(self._x.items))]
        m, k, n = gemm_dims(pass_, self.M, self.K, self.N)
        a0, b0 = pairs[0]
        if tuple(a0.data.shape) != (m, k) or tuple(b0.data.shape) != (n, k):
            raise AssertionError(f"operand shapes {a0.data.shape}, {b0.data.shape} for {m, k, n}")
        rotation = _Rotation([], 0)
        rotation.items = [list(p) for p in pairs]
        return self._measure(lambda: fp8_mm(*rotation.next(), backend=backend))
