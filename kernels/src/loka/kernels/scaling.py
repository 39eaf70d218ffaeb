"""The scale rule in Triton, bit-identical to its torch definition in `loka.schema.fp8`.

``scale = fp8_max / max(amax, AMAX_FLOOR)`` for a finite positive amax, else 1 (all-zero
rows, and amax values that are NaN or Inf); then ``min(scale, scale_ub)``; then, with
``pow2``, rounded down to a power of two (an exponent mask: exact, so dequantization is exact).
Quantization is ``saturate(x * scale)`` cast with round-to-nearest-even: ±Inf saturates to
±fp8_max, NaN stays NaN, and amax ignores both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loka.kernels.fp8_bits import fp8_encode_tl
from loka.schema.formats import AMAX_FLOOR

AMAX_FLOOR_TL: tl.constexpr = tl.constexpr(AMAX_FLOOR)


def ub_args(scale_ub: float | None) -> tuple[bool, float]:
    """The (HAS_UB, scale_ub) launch arguments of the kernels."""
    return (scale_ub is not None, 1.0 if scale_ub is None else float(scale_ub))


@triton.jit
def scale_from_amax_tl(amax, FMT: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr, scale_ub):
    """Triton twin of `loka.schema.fp8.scale_from_amax`, elementwise on a block of float32 amax values."""
    FP8_MAX_VALUE: tl.constexpr = 448.0 if FMT == 0 else 57344.0
    valid = (amax > 0.0) & (amax < float("inf"))
    safe = tl.where(valid, tl.maximum(amax, AMAX_FLOOR_TL), 1.0)
    # div_rn: the default fp32 division on GPUs is approximate, and scales must match bit for bit.
    scale = tl.where(valid, tl.math.div_rn(FP8_MAX_VALUE + 0.0 * safe, safe), 1.0)
    if HAS_UB:
        scale = tl.minimum(scale, scale_ub)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def inverse_tl(scale):
    # `1.0 + 0.0 * scale` is a float32 block (or scalar) of ones shaped like `scale`.
    return tl.math.div_rn(1.0 + 0.0 * scale, scale)


@triton.jit
def finite_abs_tl(x):
    a = tl.abs(x.to(tl.float32))
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def saturate_cast_tl(x, scale, FMT: tl.constexpr, SOFT_FP8: tl.constexpr, out_dtype: tl.constexpr):
    """Triton twin of `loka.schema.fp8.saturate_cast`: the comparisons are False for NaN, so NaN
    passes; an infinite input becomes NaN (an overflow upstream is not hidden).

    With SOFT_FP8 (the interpreter) it returns uint8 codes for a uint8 view of the output.
    """
    FP8_MAX_VALUE: tl.constexpr = 448.0 if FMT == 0 else 57344.0
    x = x.to(tl.float32)
    y = x * scale
    y = tl.where(y > FP8_MAX_VALUE, FP8_MAX_VALUE, tl.where(y < -FP8_MAX_VALUE, -FP8_MAX_VALUE, y))
    y = tl.where(tl.abs(x) == float("inf"), float("nan"), y)
    if SOFT_FP8:
        return fp8_encode_tl(y, FMT)
    else:
        return y.to(out_dtype)
