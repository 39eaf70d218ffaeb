"""What may run one pass of one GEMM site: every registered backend x recipe, with the
reason it cannot where it cannot.

Timings are keyed by a recipe's *speed key*: formats, granularity and scaling kind. Power-
of-two rounding and a scale bound change one min or mask in the scale computation, and the
history length of delayed scaling changes nothing on the GPU, so recipes that differ only
there share one measurement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from loka.kernels import registry
from loka.schema import BF16, PASSES, Recipe

BF16_BACKEND = "torch.bf16"
# A compiled model's bf16 baseline where a linear's dims are unaligned: inductor pads such a
# matmul when padding is faster, so a compiled plan compares FP8 with the faster of the two.
INDUCTOR_BF16_BACKEND = "inductor.bf16"
# Rows of a norm feeding a linear (N = 0: not a GEMM): the bf16 LayerNorm, and LayerNorm
# fused with the rowwise quantization of its output, which replaces the norm and the
# forward's quantize(x) when the norm is fused into the linear.
LAYER_NORM_BACKEND = "torch.layer_norm"
NORM_QUANTIZE_BACKEND = "loka.norm_quantize"

# Rows of the op that computes a linear's input, for a compiled plan (N = 0: not a GEMM).
# Inductor fuses the quantization of a site's input into the kernel of the op that computed
# it when that op is elementwise or a norm: such a forward pays the fused kernel's time over
# the op's alone (an amax and a narrower extra write), not a standalone quantization, which
# costs a read of the whole input more. Each kind is timed on one op that stands for its
# class (GELU, LayerNorm); `QUANTIZE_BACKEND` is the standalone quantization of the input,
# what the fusion replaces. Ops are named as `sites.producer` names them (autograd's).
PRODUCER_OPS: Mapping[str, frozenset[str]] = {
    "pointwise": frozenset({
        "gelu", "relu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu",
        "elu", "celu", "selu", "mish", "softplus", "hardtanh", "threshold", "add", "sub",
        "mul", "div", "neg", "clamp", "exp", "clone",
    }),
    "norm": frozenset({"native_layer_norm", "fused_rms_norm", "rms_norm"}),
}  # fmt: skip
QUANTIZE_BACKEND = "inductor.quantize"


def producer_kind(op: str | None) -> str | None:
    """The class (`PRODUCER_OPS`) of the op that computed a site's input, None for an op
    inductor does not fuse a quantization into (a GEMM, a concat, ...) or no op known."""
    return next((kind for kind, ops in PRODUCER_OPS.items() if op in ops), None)


def producer_backend(kind: str, quantized: bool) -> str:
    """The kernel_bench backend of a producer row: the op alone, or fused with quantize."""
    return f"inductor.{kind}" + ("+quantize" if quantized else "")


# Producer row backend -> (kind, whether the row quantizes the op's output).
PRODUCER_ROWS: Mapping[str, tuple[str, bool]] = {
    producer_backend(kind, q): (kind, q) for kind in PRODUCER_OPS for q in (False, True)
}
PRODUCER_BACKENDS = frozenset({QUANTIZE_BACKEND, *PRODUCER_ROWS})


def in_graph_quant_ms(
    quant_ms: float, operand_alone_ms: float, op_ms: float, op_quantize_ms: float
) -> float:
    """A pass's quantization time (`quant_ms`: its operands' standalone quantizations) with
    its first operand's quantization fused into the op computing it: that operand's
    standalone quantization (`operand_alone_ms`, the `inductor.quantize` row) replaced by
    what the fusion adds to the op (`op_quantize_ms - op_ms`, never below zero)."""
    return max(quant_ms - operand_alone_ms, 0.0) + max(op_quantize_ms - op_ms, 0.0)


# Timed when no site_errors table says which recipes matter: the usual candidates per pass.
DEFAULT_TIMING_RECIPES: Mapping[str, tuple[str, ...]] = {
    "fwd": (
        "e4m3:e4m3/tensor/dynamic",
        "e4m3:e4m3/row/dynamic",
        "e4m3:e4m3/block/dynamic",
        "e4m3:e4m3/tensor/delayed16",
    ),
    "dgrad": (
        "e5m2:e4m3/tensor/dynamic",
        "e4m3:e4m3/tensor/dynamic",
        "e5m2:e4m3/row/dynamic",
        "e4m3:e4m3/row/dynamic",
    ),
    "wgrad": (
        "e5m2:e4m3/tensor/dynamic",
        "e4m3:e4m3/tensor/dynamic",
        "e5m2:e4m3/row/dynamic",
        "e4m3:e4m3/row/dynamic",
    ),
}


def m_bucket(m: int) -> int:
    """M rounded to the nearest power of two in log scale (the `kernel_bench` M bucket)."""
    if m < 1:
        raise ValueError(f"M must be positive, got {m}")
    return 1 << max(0, round(math.log2(m)))


def speed_key(recipe: str | Recipe) -> str:
    """What decides a recipe's speed: 'bf16' or 'A:B/granularity/dynamic|delayed', with
    '/center' for a recipe that centers (a mean and its product more to compute)."""
    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    if r.is_bf16:
        return "bf16"
    return f"{r.a_format}:{r.b_format}/{r.granularity}/{r.scaling}" + (
        "/center" if r.center else ""
    )


def timing_recipe(recipe: str | Recipe) -> Recipe:
    """The recipe actually timed for `recipe`'s speed key (no pow2, no bound)."""
    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    if r.is_bf16:
        return BF16
    return Recipe(r.a_format, r.b_format, r.granularity, r.scaling, r.history, center=r.center)


@dataclass(frozen=True)
class Candidate:
    """One way to run one pass: a registry backend and the recipe it runs."""

    backend: str
    recipe: str
    pass_: str

    @property
    def is_bf16(self) -> bool:
        return self.recipe == "bf16"

    @property
    def fast_accum(self) -> bool:
        return self.backend.endswith(".fast")


@dataclass(frozen=True)
class CandidateStatus:
    candidate: Candidate
    refusal: str | None  # None: it can run (and be timed) here


def fusable(recipe: str | Recipe) -> bool:
    """Whether the fused norm+quantize kernel runs this forward recipe (rowwise, dynamic,
    not centered: the kernel quantizes each row as the norm writes it)."""
    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    return not r.is_bf16 and r.granularity == "row" and r.scaling == "dynamic" and not r.center


def fuses_in_graph(recipe: str | Recipe) -> bool:
    """Whether inductor fuses this forward recipe's quantization of x into the op computing
    x (the traceable backend's dynamic row or tensor scaling, not centered)."""
    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    return (
        not r.is_bf16 and r.granularity in ("row", "tensor") and r.scaling == "dynamic"
        and not r.center
    )  # fmt: skip


def recipes_by_pass(
    recipes: Mapping[str, Iterable[str]] | None = None,
) -> dict[str, list[Recipe]]:
    """One timing recipe per speed key and pass (bf16 first), from `recipes` or the defaults."""
    source = DEFAULT_TIMING_RECIPES if recipes is None else recipes
    out: dict[str, list[Recipe]] = {}
    for pass_ in PASSES:
        seen: dict[str, Recipe] = {"bf16": BF16}
        for text in source.get(pass_, ()):
            r = timing_recipe(text)
            seen.setdefault(speed_key(r), r)
        out[pass_] = list(seen.values())
    return out


def candidates(
    M: int,
    K: int,
    N: int,
    recipes: Mapping[str, Iterable[str]] | None = None,
    *,
    device: torch.device | str | None = None,
    include_fast_accum: bool = False,
    backends: Iterable[str] | None = None,
    runnable_only: bool = False,
) -> list[CandidateStatus]:
    """Every (backend, timing recipe, pass) for a linear ``x[M,K] W[N,K]^T``.

    A candidate is refused (with the backend's reason) when the backend does not support the
    recipe at this shape, or, when `device` is given, cannot be timed there (with
    `runnable_only`: cannot run there at all, e.g. Triton's CPU interpreter counts).
    """
    names = list(backends) if backends is not None else registry.names("mm")
    out: list[CandidateStatus] = []
    for pass_, pass_recipes in recipes_by_pass(recipes).items():
        for recipe in pass_recipes:
            for name in names:
                backend = registry.get(name)
                if backend.op != "mm":
                    continue
                if name.endswith(".fast") and not include_fast_accum:
                    continue
                bf16_backend = backend.runs_bf16
                if bf16_backend != recipe.is_bf16:
                    continue
                reason = backend.supports(recipe, M, K, N, pass_)
                if backend.pads_only and reason is not None:
                    continue  # a padded twin where it has nothing to pad: no candidate at all
                if reason is None and device is not None:
                    if runnable_only:
                        reason = backend.runnable_reason(device)
                    else:
                        reason = backend.unavailable_reason(device)
                out.append(CandidateStatus(Candidate(name, str(recipe), pass_), reason))
    return out
