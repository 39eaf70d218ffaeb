"""FP8 quantization of one GEMM operand under a recipe, in plain torch (CPU or GPU).

An operand is given in *pass layout*: a 2-D tensor `[rows, R]` whose second dimension is
the GEMM's reduction dimension, so that a pass computes `A @ B.T` for operands `A [P, R]`
and `B [Q, R]`. Scales can then only vary along rows (they factor out of the dot
products): tensorwise is one scale, rowwise one scale per row, blockwise one per 1x128 tile
along R for activations and gradients, and one per 128x128 tile for weights.

Semantics follow CONTRIBUTING.md: `q = saturate(x * scale)` cast to FP8 with
round-to-nearest-even, dequantized value `q / scale`, dynamic scale `fp8_max / amax`
(amax 0 gives scale 1). `x * scale` is rounded to float32 first, as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
BLOCK = 128


@dataclass(frozen=True)
class OperandScaling:
    """How one operand is scaled: FP8 format, granularity, and scale rounding."""

    format: str
    granularity: str  # "tensor", "row" or "block"
    pow2: bool = False
    scale_ub: float | None = None


def scale_from_amax(
    amax: torch.Tensor, fmt: str, *, pow2: bool = False, scale_ub: float | None = None
) -> torch.Tensor:
    """Float32 scales that map `amax` to the format's max (amax 0 gives 1), capped at
    `scale_ub`, then rounded down to a power of two when `pow2`."""
    amax = amax.float()
    scale = torch.where(amax > 0, FP8_MAX[fmt] / amax, torch.ones_like(amax))
    if scale_ub is not None:
        scale = scale.clamp(max=scale_ub)
    if pow2:
        # Rounding down keeps amax * scale within the format's range.
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _pad_to_blocks(x: torch.Tensor, pad_rows: bool) -> torch.Tensor:
    rows, cols = x.shape
    pad_c = -cols % BLOCK
    pad_r = -rows % BLOCK if pad_rows else 0
    return F.pad(x, (0, pad_c, 0, pad_r)) if pad_c or pad_r else x


def block_amax(x: torch.Tensor, *, weight: bool) -> torch.Tensor:
    """Amax of every tile, expanded back to `x`'s shape: 1x128 tiles along the reduction
    dimension for activations and gradients, 128x128 tiles for weights. Partial tiles at
    the edges hold only the elements that exist."""
    rows, cols = x.shape
    a = _pad_to_blocks(x.abs().float(), pad_rows=weight)
    pr, pc = a.shape
    if weight:
        tiles = a.view(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK).amax(dim=(1, 3), keepdim=True)
        full = tiles.expand(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK).reshape(pr, pc)
    else:
        tiles = a.view(pr, pc // BLOCK, BLOCK).amax(dim=2, keepdim=True)
        full = tiles.expand(pr, pc // BLOCK, BLOCK).reshape(pr, pc)
    return full[:rows, :cols]


def operand_scale(
    x: torch.Tensor,
    scaling: OperandScaling,
    *,
    weight: bool,
    tensor_amax: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantization scales of operand `x [rows, R]`, broadcastable to its shape.

    `tensor_amax` and `row_amax` replace the amax measured on `x` itself: a sampled operand
    is scaled as the full tensor would be (tensorwise from the full tensor's amax, or a
    delayed amax history; rowwise from amaxes over all rows of the reduction).
    """
    g = scaling.granularity
    if g == "tensor":
        amax = x.abs().amax().float() if tensor_amax is None else tensor_amax.float()
        amax = amax.reshape(1, 1)
    elif g == "row":
        amax = x.abs().amax(dim=1, keepdim=True).float() if row_amax is None else row_amax
        amax = amax.float().reshape(-1, 1)
    elif g == "block":
        amax = block_amax(x, weight=weight)
    else:
        raise ValueError(f"unknown granularity {g!r}; expected tensor, row or block")
    return scale_from_amax(amax, scaling.format, pow2=scaling.pow2, scale_ub=scaling.scale_ub)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes of `saturate(x * scale)` (round to nearest even)."""
    fmax = FP8_MAX[fmt]
    return (x.float() * scale).clamp(-fmax, fmax).to(FP8_DTYPES[fmt])


_DECODE: dict[torch.dtype, torch.Tensor] = {}


def _decode(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes as float64. On the CPU torch's FP8 cast is a slow scalar loop; a lookup
    table of the 256 codes gives the same values several times faster."""
    if q.device.type != "cpu":
        return q.double()
    if q.dtype not in _DECODE:
        _DECODE[q.dtype] = torch.arange(256, dtype=torch.uint8).view(q.dtype).double()
    codes = q.contiguous().view(torch.uint8).reshape(-1).int()
    return _DECODE[q.dtype].index_select(0, codes).view(q.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 values `q / scale` that an FP8 GEMM multiplies."""
    return _decode(q) / scale.double()
