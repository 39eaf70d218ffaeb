"""loka.kernels: FP8 quantization and GEMM kernels in Triton, and the backend registry.

The FP8 vocabulary they take (`QuantConfig`, `Recipe`, formats and constants) and the
pure-torch reference quantization are loka.schema's (`loka.schema`, `loka.schema.fp8`).
The rest of the public API is in the modules of `__public_modules__`: the registry's types
(`loka.kernels.registry`), the `*_with` forms and references of the quantizers, the
torch-native backend (`.native`), the Triton helpers for kernels built on these
(`.runtime`) and the tiles launched without autotuning (`.tuning`).
"""

from loka.kernels import backends  # noqa: F401  (importing it registers the built-in backends)
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.mm import fp8_mm, grouped_mm
from loka.kernels.norm_quantization import norm_backward, norm_quantize
from loka.kernels.quantization import quantize
from loka.kernels.registry import Backend, UnsupportedError, available, registry
from loka.kernels.transpose_quantization import quantize_transpose

__all__ = [
    "Backend",
    "Fp8Tensor",
    "UnsupportedError",
    "available",
    "fp8_mm",
    "grouped_mm",
    "norm_backward",
    "norm_quantize",
    "quantize",
    "quantize_transpose",
    "registry",
]
# Modules whose own `__all__` is public too (CONTRIBUTING.md, "Public faces").
__public_modules__ = (
    "fp8_gemm",
    "native",
    "norm_quantization",
    "quantization",
    "registry",
    "runtime",
    "transpose_quantization",
    "tuning",
)
