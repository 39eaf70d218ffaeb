"""loka.kernels: FP8 quantization and GEMM kernels in Triton, and the backend registry.

The FP8 vocabulary they take (`QuantConfig`, `Recipe`, formats and constants) and the
pure-torch reference quantization are loka.schema's (`loka.schema`, `loka.schema.fp8`).
"""

from loka.kernels import backends  # noqa: F401  (importing it registers the built-in backends)
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.mm import fp8_mm, grouped_mm
from loka.kernels.norm_quantization import NormQuantized, norm_backward, norm_quantize
from loka.kernels.quantization import quantize, quantize_reference, quantize_with
from loka.kernels.registry import (
    Backend,
    GemmSpec,
    OperandSpec,
    Registry,
    UnsupportedError,
    available,
    gemm_dims,
    registry,
)
from loka.kernels.transpose_quantization import quantize_transpose, quantize_transpose_with

__all__ = [
    "Backend",
    "Fp8Tensor",
    "GemmSpec",
    "NormQuantized",
    "OperandSpec",
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
