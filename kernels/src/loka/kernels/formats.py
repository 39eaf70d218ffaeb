"""FP8 formats, scaling granularities and the checks every public entry point shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}
GRANULARITIES: tuple[str, ...] = ("tensor", "row", "block")
# (rows, columns) of one scale tile: 1x128 for activations and gradients, 128x128 for weights.
BLOCK_SHAPES: tuple[tuple[int, int], ...] = ((1, 128), (128, 128))
PASSES: tuple[str, ...] = ("fwd", "dgrad", "wgrad")
ACTIVATIONS: tuple[str | None, ...] = (None, "relu", "gelu", "silu")
HIGH_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

# Below this amax a dynamic scale would overflow fp32; amax is floored here (torchao uses the same).
AMAX_FLOOR = 1e-12
_SMALLEST_NORMAL_F32 = 2.0**-126


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of an FP8 format name, or a ValueError naming the allowed ones."""
    try:
        return FP8_DTYPES[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"FP8 format must be one of {tuple(FP8_DTYPES)}, got {fmt!r}") from None


def format_of(dtype: torch.dtype) -> str:
    for name, dt in FP8_DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"expected an FP8 tensor (float8_e4m3fn or float8_e5m2), got {dtype}")


def check_granularity(granularity: str, block: tuple[int, int] | None) -> tuple[int, int] | None:
    """Validate a granularity and return the block shape it uses (None unless 'block')."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "block":
        if block is not None:
            raise ValueError(f"block={block} only applies to granularity='block'")
        return None
    block = (1, 128) if block is None else tuple(block)
    if block not in BLOCK_SHAPES:
        raise ValueError(f"block must be one of {BLOCK_SHAPES}, got {block}")
    return block


def check_scale_ub(scale_ub: float | None) -> float | None:
    if scale_ub is None:
        return None
    ub = float(scale_ub)
    # A subnormal bound would make power-of-two rounding (an exponent mask) return zero.
    if not (math.isfinite(ub) and ub >= _SMALLEST_NORMAL_F32):
        raise ValueError(f"scale_ub must be a finite number >= 2**-126, got {scale_ub!r}")
    return ub


def check_high_precision_2d(x: object, name: str = "x") -> torch.Tensor:
    """A 2-D bf16/fp16/fp32 tensor, or a TypeError/ValueError saying what is wrong."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    return x


def check_activation(activation: str | None) -> str | None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_out_dtype(out_dtype: torch.dtype) -> torch.dtype:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return out_dtype


def check_pass(pass_: str) -> str:
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    return pass_


def scale_grid(rows: int, cols: int, granularity: str, block: tuple[int, int] | None) -> tuple:
    """Shape of the scale tensor of a [rows, cols] operand."""
    if granularity == "tensor":
        return (1,)
    if granularity == "row":
        return (rows,)
    br, bc = block
    return (-(-rows // br), -(-cols // bc))


@dataclass(frozen=True)
class QuantConfig:
    """How one operand is quantized: format, granularity (and block), scale options.

    Validated on construction; ``block`` defaults to (1, 128) for granularity 'block'.
    """

    fmt: str = "e4m3"
    granularity: str = "row"
    block: tuple[int, int] | None = None
    pow2: bool = False
    scale_ub: float | None = None

    def __post_init__(self) -> None:
        fp8_dtype(self.fmt)
        object.__setattr__(self, "block", check_granularity(self.granularity, self.block))
        object.__setattr__(self, "scale_ub", check_scale_ub(self.scale_ub))
        if not isinstance(self.pow2, bool):
            raise TypeError(f"pow2 must be a bool, got {type(self.pow2).__name__}")

    @property
    def dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fmt]

    def scale_shape(self, rows: int, cols: int) -> tuple:
        return scale_grid(rows, cols, self.granularity, self.block)
