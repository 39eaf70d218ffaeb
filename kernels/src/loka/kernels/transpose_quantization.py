"""Fused transpose-quantize: ``x`` row-quantized and ``x^T`` row-quantized (``x`` quantized by
column), written together from one read of ``x`` per tile (what the wgrad pass needs).

Per granularity:
- ``tensor``: both share one scale; an amax pass (skipped with a given, delayed amax), then
  one read writing both outputs.
- ``row``: a row scale needs a whole row and a column scale a whole column, so one read
  gathers both amax vectors and a second read writes both outputs: 2 reads for the pair,
  against 3 for a rowwise pass plus a separate column pass (amax, then quantize).
- ``block`` (1x128 or 128x128): a 128x128 tile holds every group it needs, so one read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.formats import check_high_precision_2d
from loka.kernels.fp8_bits import FORMAT_IDS
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.launch import Launcher
from loka.kernels.quantization import (
    _check_amax,
    _launch_amax_partials,
    _store_group_stats,
    _tensor_tiles,
    cached_config,
    quantize_reference,
    quantize_with,
    tensor_amax_tl,
)
from loka.kernels.runtime import aligned, cdiv, interpreting, next_pow2, require_triton_device
from loka.kernels.scaling import (
    finite_abs_tl,
    inverse_tl,
    saturate_cast_tl,
    scale_from_amax_tl,
    ub_args,
)
from loka.schema import QuantConfig

__all__ = [
    "quantize_transpose",
    "quantize_transpose_reference",
    "quantize_transpose_with",
]

MODES = {"tensor": 0, "row": 1, "block1": 2, "block128": 3}


@triton.jit
def _row_col_amax_kernel(
    x_ptr, amax_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Row and column amaxes by atomic max into amax = [rows (R) | columns (C)], zeroed.

    Amaxes are finite and >= 0, so their float32 bits order like int32: one integer atomic
    max per value (a float atomic max takes two, one per sign).
    """
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    a = finite_abs_tl(x)
    row_bits = tl.max(a, axis=1).to(tl.int32, bitcast=True)
    col_bits = tl.max(a, axis=0).to(tl.int32, bitcast=True)
    bits_ptr = amax_ptr.to(tl.pointer_type(tl.int32))
    tl.atomic_max(bits_ptr + rows, row_bits, mask=rows < R, sem="relaxed")
    tl.atomic_max(bits_ptr + R + cols, col_bits, mask=cols < C, sem="relaxed")


@triton.jit
def _transpose_quantize_kernel(
    x_ptr, q_ptr, qt_ptr, amax_in_ptr, gathered_ptr,
    q_amax_ptr, q_scale_ptr, q_inv_ptr, t_amax_ptr, t_scale_ptr, t_inv_ptr,
    R, C, stride_r, stride_c, q_scale_stride, t_scale_stride, partials, scale_ub,
    MODE: tl.constexpr, FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr,
    HAS_UB: tl.constexpr, DELAYED: tl.constexpr, PARTIALS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Tile (i, j) of x: writes q[rows, cols] and qt[cols, rows] with their scales.

    MODE 0 tensor: one scale for both (the q_* pointers); q_amax = [amax, partial amaxes...]
    and the amax is the max of the partials, or with DELAYED the scale comes from amax_in and
    the amax seen in x is gathered by atomic max. MODE 1 row: `gathered` = [row amaxes (R) |
    column amaxes (C)] from `_row_col_amax_kernel`, copied out with the scales by the first
    column / row of tiles. MODE 2 blocks of 1x128, MODE 3 blocks of 128x128 (BLOCK_R = BLOCK_C
    = 128): amaxes of the tile.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    r_ok = rows < R
    c_ok = cols < C
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    out_ty = q_ptr.dtype.element_ty
    if MODE == 0:
        amax = tensor_amax_tl(x, amax_in_ptr, q_amax_ptr, partials, DELAYED, PARTIALS)
        scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, out_ty)
        qt = tl.trans(q)
        if (pid_r == 0) & (pid_c == 0):
            if not DELAYED:
                tl.store(q_amax_ptr, amax)
            tl.store(q_scale_ptr, scale)
            tl.store(q_inv_ptr, inverse_tl(scale))
    elif MODE == 3:
        amax = tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0)
        scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, out_ty)
        qt = tl.trans(q)
        q_at = pid_r * q_scale_stride + pid_c
        t_at = pid_c * t_scale_stride + pid_r
        _store_group_stats(q_amax_ptr, q_scale_ptr, q_inv_ptr, q_at, amax, scale, True)
        _store_group_stats(t_amax_ptr, t_scale_ptr, t_inv_ptr, t_at, amax, scale, True)
    else:
        if MODE == 1:
            row_amax = tl.load(gathered_ptr + rows, mask=r_ok, other=0.0)
            col_amax = tl.load(gathered_ptr + R + cols, mask=c_ok, other=0.0)
        else:
            a = finite_abs_tl(x)
            row_amax = tl.max(a, axis=1)
            col_amax = tl.max(a, axis=0)
        row_scale = scale_from_amax_tl(row_amax, FMT, POW2, HAS_UB, scale_ub)
        col_scale = scale_from_amax_tl(col_amax, FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, row_scale[:, None], FMT, SOFT_FP8, out_ty)
        qt = tl.trans(saturate_cast_tl(x, col_scale[None, :], FMT, SOFT_FP8, out_ty))
        if MODE == 2:
            row_at = rows * q_scale_stride + pid_c
            col_at = cols * t_scale_stride + pid_r
            _store_group_stats(
                q_amax_ptr, q_scale_ptr, q_inv_ptr, row_at, row_amax, row_scale, r_ok
            )
            _store_group_stats(
                t_amax_ptr, t_scale_ptr, t_inv_ptr, col_at, col_amax, col_scale, c_ok
            )
        else:  # the first column / row of tiles writes the row / column stats
            if pid_c == 0:
                _store_group_stats(
                    q_amax_ptr, q_scale_ptr, q_inv_ptr, rows, row_amax, row_scale, r_ok
                )
            if pid_r == 0:
                _store_group_stats(
                    t_amax_ptr, t_scale_ptr, t_inv_ptr, cols, col_amax, col_scale, c_ok
                )
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[:, None] * R + rows[None, :], qt, mask=tl.trans(mask))


_ROW_COL_AMAX = Launcher(_row_col_amax_kernel)
_TRANSPOSE_QUANTIZE = Launcher(_transpose_quantize_kernel)


# GPU tiles: the quantizing pass's (BLOCK_R, BLOCK_C) and warps for row and tensor scales
# ("quantize", "warps"; blocks always take 128x128 tiles, "block_warps"), and the row/column
# amax pass's tile. Registers bound the occupancy here: a 128x128 tile on 8 warps takes about
# 200 per thread. Measured on an H200 (bench/kernels.py --sections tune).
TILES: dict = {"quantize": (32, 128), "warps": 4, "block_warps": 8, "amax": (256, 128)}


def _tiles(mode: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(quantizing tile, amax tile, warps of the quantizing pass)."""
    if interpreting():  # small tiles: tests cross tile boundaries
        return ((128, 128) if mode >= 2 else (32, 32)), (32, 16), 4
    if mode >= 2:
        return (128, 128), TILES["amax"], TILES["block_warps"]
    return TILES["quantize"], TILES["amax"], TILES["warps"]


def quantize_transpose(
    x: torch.Tensor,
    fmt: str = "e4m3",
    granularity: str = "row",
    *,
    block: tuple[int, int] | None = None,
    pow2: bool = False,
    scale_ub: float | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """(`x` quantized, `x^T` quantized), both row-major with scales along their rows.

    Options as in `quantize`; `amax` (delayed scaling) is for granularity 'tensor' only.
    """
    return quantize_transpose_with(x, cached_config(fmt, granularity, block, pow2, scale_ub), amax)


def quantize_transpose_with(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """`quantize_transpose` with its options in a `QuantConfig`."""
    x = check_high_precision_2d(x)
    granularity = config.granularity
    if amax is not None and granularity != "tensor":
        raise ValueError("a given amax (delayed scaling) applies to granularity 'tensor' only")
    R, C = x.shape
    device = x.device
    amax_in = _check_amax(amax, (1,), device)
    require_triton_device(x)
    if x.numel() == 0:
        q = quantize_with(x, config, amax_in)
        return q, quantize_with(x.t(), config, amax_in)
    mode = MODES[granularity if granularity != "block" else f"block{config.block[0]}"]
    (br, bc), (abr, abc), warps = _tiles(mode)
    delayed = amax_in is not None
    key = (R, C, *x.stride(), x.dtype, config, aligned(x), delayed and aligned(amax_in))
    q = torch.empty((R, C), dtype=config.dtype, device=device)
    qt = torch.empty((C, R), dtype=config.dtype, device=device)
    partials = 0
    gathered = None
    f32 = torch.float32
    if mode == 0:  # one scale: qt shares q's amax, scale and inverse scale
        if delayed:
            q_amax = torch.zeros(1, dtype=f32, device=device)
        else:  # [amax, partial amaxes...]
            partials = _tensor_tiles(R, C)[-1]
            q_amax = torch.empty(1 + partials, dtype=f32, device=device)
            _launch_amax_partials(x, q_amax)
        q_scale = torch.empty(1, dtype=f32, device=device)
        q_inv = torch.empty(1, dtype=f32, device=device)
        t_amax, t_scale, t_inv = q_amax, q_scale, q_inv
        q_shape = t_shape = (1,)
    else:
        # Six tensors, not views of one buffer: callers (custom ops) may not return aliases.
        q_shape, t_shape = config.scale_shape(R, C), config.scale_shape(C, R)
        q_amax = torch.empty(q_shape, dtype=f32, device=device)
        q_scale = torch.empty(q_shape, dtype=f32, device=device)
        q_inv = torch.empty(q_shape, dtype=f32, device=device)
        t_amax = torch.empty(t_shape, dtype=f32, device=device)
        t_scale = torch.empty(t_shape, dtype=f32, device=device)
        t_inv = torch.empty(t_shape, dtype=f32, device=device)
        if mode == 1:  # row and column amaxes gathered by atomics in one zeroed scratch buffer
            gathered = torch.zeros(R + C, dtype=f32, device=device)
            args = (x, gathered, R, C, *x.stride())
            plan = _ROW_COL_AMAX.lookup(key)
            if plan is None:
                grid = (cdiv(R, abr), cdiv(C, abc))
                _ROW_COL_AMAX(key, grid, args, {"BLOCK_R": abr, "BLOCK_C": abc}, num_warps=8)
            else:
                _ROW_COL_AMAX.launch(plan, args)
    soft = interpreting()
    has_ub, ub = ub_args(config.scale_ub)
    args = (
        x, q.view(torch.uint8) if soft else q, qt.view(torch.uint8) if soft else qt,
        amax_in if delayed else q_amax, q_amax if gathered is None else gathered,
        q_amax, q_scale, q_inv, t_amax, t_scale, t_inv, R, C, *x.stride(),
        q_shape[-1] if mode >= 2 else 0, t_shape[-1] if mode >= 2 else 0, partials, ub,
    )  # fmt: skip
    plan = _TRANSPOSE_QUANTIZE.lookup(key)
    if plan is None:
        meta = dict(
            MODE=mode, FMT=FORMAT_IDS[config.fmt], SOFT_FP8=soft, POW2=config.pow2,
            HAS_UB=has_ub, DELAYED=delayed, PARTIALS=next_pow2(max(partials, 1)),
            BLOCK_R=br, BLOCK_C=bc,
        )  # fmt: skip
        grid = (cdiv(R, br), cdiv(C, bc))
        _TRANSPOSE_QUANTIZE(key, grid, args, meta, num_warps=warps)
    else:
        _TRANSPOSE_QUANTIZE.launch(plan, args)
    if mode == 0 and not delayed:
        q_amax = t_amax = q_amax[:1]
    g, blk = granularity, config.block
    return (
        Fp8Tensor._trusted(q, q_scale, q_inv, q_amax, config.fmt, g, blk),
        Fp8Tensor._trusted(qt, t_scale, t_inv, t_amax, config.fmt, g, blk),
    )


def quantize_transpose_reference(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Pure torch: `quantize_reference` of x and of x^T."""
    return quantize_reference(x, config, amax), quantize_reference(x.t().contiguous(), config, amax)
