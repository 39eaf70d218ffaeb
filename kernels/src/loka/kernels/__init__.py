"""loka.kernels: FP8 quantization and GEMM kernels in Triton, and the backend registry."""

from loka.kernels import backends  # noqa: F401  (importing it registers the built-in backends)
from loka.kernels.formats import FP8_DTYPES, FP8_MAX, GRANULARITIES, PASSES, QuantConfig
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.mm import fp8_mm, grouped_mm
from loka.kernels.norm_quantization import NormQuantized, norm_backward, norm_quantize
from loka.kernels.quantization import quantize, quantize_reference, quantize_with
from loka.kernels.registry import (
    Backend,
    GemmSpec,
    KernelRecipe,
    OperandSpec,
    Registry,
    UnsupportedError,
    available,
    gemm_dims,
    registry,
)
from loka.kernels.transpose_quantization import quantize_transpose, quantize_transpose_with

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "GRANULARITIES",
    "PASSES",
    "Backend",
    "Fp8Tensor",
    "GemmSpec",
    "KernelRecipe",
    "NormQuantized",
    "OperandSpec",
    "QuantConfig",
    "Registry",
    "UnsupportedError",
    "available",
    "fp8_mm",
    "gemm_dims",
    "grouped_mm",
    "norm_backward",
    "norm_quantize",
    "quantize",
    "quantize_reference",
    "quantize_transpose",
    "quantize_transpose_with",
    "quantize_with",
    "registry",
]
