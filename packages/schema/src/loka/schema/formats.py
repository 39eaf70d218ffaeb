"""The constants of LoKA's FP8 vocabulary, once for every package (CONTRIBUTING.md, "Shared
vocabulary"). Plain Python: importing them needs neither torch nor polars.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = [
    "ACTIVATION_BLOCK",
    "AMAX_FLOOR",
    "BLOCK_SHAPES",
    "FP8_FORMATS",
    "FP8_MAX",
    "GRANULARITIES",
    "MIN_SCALE_UB",
    "PASSES",
    "ROLES",
    "SCALINGS",
    "WEIGHT_BLOCK",
    "WEIGHT_OPERANDS",
]

FP8_FORMATS: tuple[str, ...] = ("e4m3", "e5m2")
# Largest finite value of each format: e4m3 is torch.float8_e4m3fn (finite-only), e5m2 is
# torch.float8_e5m2 (IEEE-like, with Inf).
FP8_MAX: MappingProxyType[str, float] = MappingProxyType({"e4m3": 448.0, "e5m2": 57344.0})
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
# (rows, columns) of one scale tile: 1x128 for activations and gradients, 128x128 for weights.
ACTIVATION_BLOCK: tuple[int, int] = (1, 128)
WEIGHT_BLOCK: tuple[int, int] = (128, 128)
BLOCK_SHAPES: tuple[tuple[int, int], ...] = (ACTIVATION_BLOCK, WEIGHT_BLOCK)
SCALINGS: tuple[str, ...] = ("dynamic", "delayed")
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
PASSES: tuple[str, ...] = ("fwd", "dgrad", "wgrad")
# Whether operand (a, b) of each pass of ``y = x W^T`` is the weight: fwd ``x W^T``,
# dgrad ``dY (W^T)^T``, wgrad ``dY^T (x^T)^T``. A weight takes 128x128 blocks.
WEIGHT_OPERANDS: MappingProxyType[str, tuple[bool, bool]] = MappingProxyType(
    {"fwd": (False, True), "dgrad": (False, True), "wgrad": (False, False)}
)
# A dynamic scale is fp8_max / max(amax, AMAX_FLOOR): below this amax the scale would
# overflow float32 (torchao floors amax at the same value).
AMAX_FLOOR = 1e-12
# The smallest scale upper bound: a subnormal bound would make power-of-two rounding (an
# exponent mask) return zero.
MIN_SCALE_UB = 2.0**-126
