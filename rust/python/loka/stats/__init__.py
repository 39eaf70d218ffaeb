"""Streaming, mergeable statistics of sampled tensors for FP8 decisions (Rust core).

`Sketch` summarizes a stream of float32/float16/bfloat16 values: exact counts (zeros,
subnormals, NaN, +-Inf), extremes and moments, quantiles of |x| with a guaranteed relative
error, the exact exponent histogram, per-row and per-block amax distributions, and the FP8
range fit at any scale. `ErrorAccumulator` tracks the error of an approximation against a
reference. `fp8_quantize` / `fp8_dequantize` / `fp8_roundtrip` emulate torch's FP8 casts on
the CPU, bit for bit. No torch needed.
"""

from types import MappingProxyType

from loka.stats._native import (
    FORMAT_VERSION,
    ErrorAccumulator,
    Fp8Format,
    RangeFit,
    Sketch,
    fp8_dequantize,
    fp8_formats,
    fp8_quantize,
    fp8_roundtrip,
)

FP8_FORMATS: MappingProxyType[str, Fp8Format] = MappingProxyType({f.name: f for f in fp8_formats()})
"""The FP8 formats by the project's names: ``"e4m3"`` (max 448) and ``"e5m2"`` (max 57344)."""

__all__ = [
    "FORMAT_VERSION",
    "FP8_FORMATS",
    "ErrorAccumulator",
    "Fp8Format",
    "RangeFit",
    "Sketch",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_roundtrip",
]
