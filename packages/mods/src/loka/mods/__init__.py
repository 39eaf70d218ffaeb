"""loka.mods"""

from loka.mods.apply import Change, ModsError, Report, apply, undo
from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.fp8_linear import Fp8Linear, convert_to_fp8_linear, convert_to_linear
from loka.mods.grouped import GroupedLinear, GroupLayout
from loka.mods.norm_linear import FusedNorm, NormLinear
from loka.mods.reference import fp8_linear_reference
from loka.mods.smoothing import fold_norm_bias, smooth
from loka.mods.spec import GroupMods, ModSpec, SiteMods
from loka.mods.weight_stamp import invalidate_weight_caches

__all__: list[str] = [
    "Change",
    "Fp8Linear",
    "Fp8LinearConfig",
    "FusedNorm",
    "GroupLayout",
    "GroupMods",
    "GroupedLinear",
    "ModSpec",
    "ModsError",
    "NormLinear",
    "PassConfig",
    "Report",
    "SiteMods",
    "apply",
    "convert_to_fp8_linear",
    "convert_to_linear",
    "fold_norm_bias",
    "fp8_linear_reference",
    "invalidate_weight_caches",
    "smooth",
    "undo",
]
