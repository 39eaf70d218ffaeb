"""loka.kernels: FP8 quantization and GEMM kernels in Triton, and the backend registry."""

from loka.kernels.formats import FP8_DTYPES, FP8_MAX, GRANULARITIES, PASSES, QuantConfig
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.quantization import quantize, quantize_reference, quantize_with

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "GRANULARITIES",
    "PASSES",
    "Fp8Tensor",
    "QuantConfig",
    "quantize",
    "quantize_reference",
    "quantize_with",
]
