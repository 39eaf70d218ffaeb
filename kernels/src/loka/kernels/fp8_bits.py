"""Exact FP8 encoding and decoding with integer arithmetic, for Triton's CPU interpreter.

The interpreter converts float32 to FP8 by truncating the mantissa with a one-bit rounding
correction (wrong for ties, carries and subnormals) and turns NaN into a finite value, so
under TRITON_INTERPRET=1 the kernels store FP8 bytes computed here instead (``SOFT_FP8``).
On a GPU the hardware conversion (``cvt.rn.satfinite``, round to nearest even) is used and
these functions are not compiled in. Format ids: 0 = e4m3 (``float8_e4m3fn``), 1 = e5m2.
"""

from __future__ import annotations

import triton
import triton.language as tl

FORMAT_IDS = {"e4m3": 0, "e5m2": 1}


@triton.jit
def fp8_encode_tl(y, FMT: tl.constexpr):
    """uint8 codes of float32 values already saturated to the format's range (NaN allowed)."""
    MBITS: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    EMIN: tl.constexpr = -6 if FMT == 0 else -14
    NAN_CODE: tl.constexpr = 0x7F if FMT == 0 else 0x7E
    SUB_UNITS_PER_ONE: tl.constexpr = 512.0 if FMT == 0 else 65536.0  # 2**-(EMIN - MBITS)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.where(y != y, 0.0, tl.abs(y))  # NaN is coded at the end; keep the arithmetic finite
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    # Round to the FP8 grid with the float32 "magic number" trick: adding 1.5 * 2**23 to a
    # value below 2**22 leaves its nearest-even integer in the low mantissa bits.
    inv_ulp = ((127 - (exp - MBITS)) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 + (exp - MBITS)) << 23).to(tl.float32, bitcast=True)
    units = (a * inv_ulp + 12582912.0) - 12582912.0
    r = units * ulp
    rbits = r.to(tl.int32, bitcast=True)
    rexp = ((rbits >> 23) & 0xFF) - 127
    normal = ((rexp + BIAS) << MBITS) | ((rbits & 0x7FFFFF) >> (23 - MBITS))
    subnormal = (tl.minimum(r, 1.0) * SUB_UNITS_PER_ONE).to(tl.int32)  # used below 2**EMIN only
    code = tl.where(rexp >= EMIN, normal, subnormal)
    code = tl.where(r == 0.0, 0, code)
    code = tl.where(y != y, NAN_CODE, code | (sign << 7))
    return code.to(tl.uint8)


@triton.jit
def fp8_decode_tl(code, FMT: tl.constexpr):
    """float32 values of uint8 FP8 codes (exact, NaN and Inf included)."""
    MBITS: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    EBITS: tl.constexpr = 4 if FMT == 0 else 5
    SUB_UNIT: tl.constexpr = 0.001953125 if FMT == 0 else 1.52587890625e-05  # 2**(EMIN - MBITS)
    c = code.to(tl.int32)
    sign = (c >> 7) & 1
    e = (c >> MBITS) & ((1 << EBITS) - 1)
    m = c & ((1 << MBITS) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * SUB_UNIT, normal)
    if FMT == 0:
        v = tl.where((e == 15) & (m == 7), float("nan"), v)
    else:
        v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
    return tl.where(sign == 1, -v, v)
