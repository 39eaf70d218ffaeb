"""loka.mods: FP8 model adaptations, applied from a `ModSpec` and undone as one.

    report = apply(model, ModSpec(sites={"blocks.0.fc1": SiteMods(fp8=Fp8LinearConfig())}))
    undo(model, report)                     # or report.undo()

The modules themselves (`NormLinear`, `GroupedLinear`, ...), the transforms (`smoothing`)
and the references are public in the modules of `__public_modules__`.
"""

from loka.mods.apply import ModsError, Report, apply, undo
from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.fp8_linear import (
    Fp8Linear,
    convert_to_fp8_linear,
    prequantize_weights,
    release_prequantized_weights,
)
from loka.mods.spec import ModSpec, SiteMods

__all__: list[str] = [
    "Fp8Linear",
    "Fp8LinearConfig",
    "ModSpec",
    "ModsError",
    "PassConfig",
    "Report",
    "SiteMods",
    "apply",
    "convert_to_fp8_linear",
    "prequantize_weights",
    "release_prequantized_weights",
    "undo",
]
# Modules whose own `__all__` is public too (CONTRIBUTING.md, "Public faces").
__public_modules__ = (
    "apply",
    "checkpointing",
    "config",
    "dtypes",
    "eager_graphs",
    "fp8_linear",
    "grouped",
    "norm_linear",
    "reference",
    "sharding",
    "smoothing",
    "spec",
    "static_scales",
    "trace",
    "weight_stamp",
)
