"""The reference FP8 quantization in plain torch: the definition every LoKA implementation
is pinned to, bit for bit (the Triton kernels, the torch-native backend, Probe's emulation;
`loka.stats` casts with its own Rust code and is pinned to this in the tests).

Scales: ``scale = fp8_max / max(amax, AMAX_FLOOR)`` for a finite positive amax, else 1 (an
all-zero group, or an amax that is NaN or Inf); then ``min(scale, scale_ub)``; then, with
``pow2``, rounded down to a power of two (an exponent mask: exact, so dequantizing is exact).
amax ignores NaN and Inf. Quantization: ``saturate(x * scale)``, the product rounded to
float32, cast with round-to-nearest-even; +-Inf saturates to +-fp8_max, NaN stays NaN. The
dequantized value is ``q / scale``.

This module imports torch, which loka-schema does not require: install
``loka-schema[torch]`` (every LoKA package that quantizes depends on torch already).
`import loka.schema` itself never loads it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "loka.schema.fp8 (the reference FP8 quantization) needs torch: "
        "pip install 'loka-schema[torch]'"
    ) from exc

from loka.schema.formats import AMAX_FLOOR, FP8_MAX
from loka.schema.recipe import QuantConfig, RecipeError, scale_grid

__all__ = [
    "FP8_DTYPES",
    "Quantized",
    "dequantize",
    "expand_scale",
    "finite_abs",
    "fp8_dtype",
    "fp8_values",
    "group_amax",
    "quantize_reference",
    "saturate_cast",
    "scale_from_amax",
]

FP8_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
)


# Each format's largest value as a float32 CPU scalar (the eager dividend of `scale_from_amax`).
_FP8_MAX_SCALARS: MappingProxyType[str, torch.Tensor] = MappingProxyType(
    {fmt: torch.tensor(m, dtype=torch.float32, device="cpu") for fmt, m in FP8_MAX.items()}
)


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of an FP8 format name, or a RecipeError naming the allowed ones."""
    try:
        return FP8_DTYPES[fmt]
    except (KeyError, TypeError):
        raise RecipeError(f"FP8 format must be one of {tuple(FP8_DTYPES)}, got {fmt!r}") from None


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in float32 with NaN and Inf replaced by 0: what amax measures."""
    # One op for NaN and +Inf (|x| has no -Inf): an eager FP8 pass pays host time per op.
    return x.float().abs().nan_to_num_(nan=0.0, posinf=0.0)  # in place: abs made it fresh


def scale_from_amax(
    amax: torch.Tensor,
    fmt: str,
    pow2: bool = False,
    scale_ub: float | None = None,
    *,
    finite: bool = False,
) -> torch.Tensor:
    """Float32 scales from amax values (any shape). `finite`: the caller knows every amax
    is finite and >= 0 (taken over `finite_abs`), so only zero needs the fallback scale."""
    amax = amax.float()
    valid = amax > 0 if finite else (amax > 0) & (amax < float("inf"))
    # A division, not `scalar / tensor` (torch computes that as reciprocal times scalar,
    # another rounding). Eagerly the dividend is a CPU 0-dim tensor, which TensorIterator
    # passes to the kernel as an argument (the same correctly rounded a / b, on the CPU and
    # CUDA alike): no fill launch per call. Traced, full_like keeps the graph as it was.
    if torch.compiler.is_compiling():
        fp8_max = torch.full_like(amax, FP8_MAX[fmt])
    else:
        fp8_max = _FP8_MAX_SCALARS[fmt]
    scale = torch.where(valid, torch.div(fp8_max, amax.clamp_min(AMAX_FLOOR)), 1.0)
    if scale_ub is not None:
        scale = scale.clamp_max(scale_ub)
    if pow2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def saturate_cast(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``saturate(x * scale)`` cast to FP8 (`scale` broadcasts against `x`): a finite value
    beyond the format's range becomes its largest value, NaN stays NaN, and an infinite
    value becomes NaN. Inf is an overflow upstream (an fp16 gradient under `GradScaler`);
    saturated, it would reach the GEMM's output as a finite number and the scaler, which
    skips a step only on a non-finite gradient, would apply garbage."""
    m = FP8_MAX[fmt]
    x32 = x.float()
    y = (x32 * scale).clamp_(-m, m).masked_fill_(x32.isinf(), float("nan"))
    return y.to(fp8_dtype(fmt))


def group_amax(x: torch.Tensor, granularity: str, block: tuple[int, int] | None) -> torch.Tensor:
    """The amax of each scale group of a 2-D `x` (NaN and Inf ignored), float32, shaped like
    its scales (`scale_grid`); partial blocks at the edges hold only the values that exist."""
    a = finite_abs(x)
    R, C = x.shape
    if granularity == "tensor":
        return a.amax().reshape(1) if a.numel() else torch.zeros(1, device=x.device)
    if granularity == "row":
        return a.amax(dim=1) if C else torch.zeros(R, device=x.device)
    br, bc = block
    gr, gc = scale_grid(R, C, granularity, block)
    padded = torch.zeros(gr * br, gc * bc, device=x.device)
    padded[:R, :C] = a
    return padded.view(gr, br, gc, bc).amax(dim=(1, 3))


def expand_scale(
    scale: torch.Tensor, rows: int, cols: int, granularity: str, block: tuple[int, int] | None
) -> torch.Tensor:
    """Per-group values (scales, amaxes) broadcast to one per element of ``[rows, cols]``."""
    if granularity == "tensor":
        return scale.view(1, 1).expand(rows, cols)
    if granularity == "row":
        return scale.view(rows, 1).expand(rows, cols)
    br, bc = block
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


class Quantized(NamedTuple):
    """An operand quantized by `quantize_reference`."""

    data: torch.Tensor  # [rows, cols] FP8
    scale: torch.Tensor  # float32, shaped by `scale_grid`
    amax: torch.Tensor  # the amax measured in x per group (what delayed scaling records)


def quantize_reference(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> Quantized:
    """Quantize a 2-D `x` as `config` says. `amax`, shaped like the scales, replaces the
    measured amax when setting the scales (delayed scaling, or the amax of a larger tensor
    `x` was sampled from); the returned amax is always the one measured in `x`."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    seen = group_amax(x, config.granularity, config.block)
    if amax is not None and tuple(amax.shape) != tuple(seen.shape):
        raise ValueError(
            f"amax must have the scales' shape {tuple(seen.shape)}, got {tuple(amax.shape)}"
        )
    scale = scale_from_amax(
        seen if amax is None else amax, config.fmt, config.pow2, config.scale_ub
    )
    full = expand_scale(scale, rows, cols, config.granularity, config.block)
    return Quantized(saturate_cast(x, full, config.fmt), scale, seen)


_DECODE: dict[torch.dtype, torch.Tensor] = {}


def fp8_values(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes as float64. On the CPU torch's FP8 cast is a slow scalar loop; a lookup
    table of the 256 codes gives the same values several times faster."""
    if q.device.type != "cpu":
        return q.double()
    if q.dtype not in _DECODE:
        _DECODE[q.dtype] = torch.arange(256, dtype=torch.uint8).view(q.dtype).double()
    codes = q.contiguous().view(torch.uint8).reshape(-1).int()
    return _DECODE[q.dtype].index_select(0, codes).view(q.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 values ``q / scale`` that an FP8 GEMM multiplies (`scale` broadcasts
    against `q`: expand group scales with `expand_scale`)."""
    return fp8_values(q) / scale.double()
