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

from loka.kernels.formats import QuantConfig, check_high_precision_2d
from loka.kernels.fp8_bits import FORMAT_IDS
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.quantization import _amax_kernel, _check_amax, quantize_reference, quantize_with
from loka.kernels.runtime import interpreting, require_triton_device
from loka.kernels.scaling import (
    finite_abs_tl,
    inverse_tl,
    saturate_cast_tl,
    scale_from_amax_tl,
    ub_args,
)

MODES = {"tensor": 0, "row": 1, "block1": 2, "block128": 3}


@triton.jit
def _row_col_amax_kernel(
    x_ptr, row_amax_ptr, col_amax_ptr, R, C, stride_r, stride_c,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    a = finite_abs_tl(x)
    tl.atomic_max(row_amax_ptr + rows, tl.max(a, axis=1), mask=rows < R)
    tl.atomic_max(col_amax_ptr + cols, tl.max(a, axis=0), mask=cols < C)


@triton.jit
def _store_scales(amax_ptr, scale_ptr, inv_ptr, at, amax, scale, mask):
    tl.store(amax_ptr + at, amax, mask=mask)
    tl.store(scale_ptr + at, scale, mask=mask)
    tl.store(inv_ptr + at, inverse_tl(scale), mask=mask)


@triton.jit
def _transpose_quantize_kernel(
    x_ptr, q_ptr, qt_ptr, amax_in_ptr, col_amax_in_ptr,
    q_amax_ptr, q_scale_ptr, q_inv_ptr, qt_amax_ptr, qt_scale_ptr, qt_inv_ptr,
    R, C, stride_r, stride_c, q_scale_stride, qt_scale_stride, scale_ub,
    MODE: tl.constexpr, FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr,
    HAS_UB: tl.constexpr, RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Tile (i, j) of x: writes q[rows, cols] and qt[cols, rows] with their scales.

    MODE 0 tensor (amax_in: the amax setting the scale; RECORD_AMAX: also measure x's amax
    into q_amax, for delayed scaling), 1 row (amax_in: rows, col_amax_in: columns),
    2 blocks of 1x128 (BLOCK_R = BLOCK_C = 128), 3 blocks of 128x128.
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
        scale = scale_from_amax_tl(tl.load(amax_in_ptr), FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, out_ty)
        qt = q
        if RECORD_AMAX:
            tl.atomic_max(q_amax_ptr, tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0))
        if (pid_r == 0) & (pid_c == 0):
            tl.store(q_scale_ptr, scale)
            tl.store(q_inv_ptr, inverse_tl(scale))
    elif MODE == 3:
        amax = tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0)
        scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, out_ty)
        qt = q
        _store_scales(
            q_amax_ptr, q_scale_ptr, q_inv_ptr, pid_r * q_scale_stride + pid_c, amax, scale, True
        )
        _store_scales(
            qt_amax_ptr,
            qt_scale_ptr,
            qt_inv_ptr,
            pid_c * qt_scale_stride + pid_r,
            amax,
            scale,
            True,
        )
    else:
        if MODE == 1:
            row_amax = tl.load(amax_in_ptr + rows, mask=r_ok, other=0.0)
            col_amax = tl.load(col_amax_in_ptr + cols, mask=c_ok, other=0.0)
            row_at = rows
            col_at = cols
        else:
            a = finite_abs_tl(x)
            row_amax = tl.max(a, axis=1)
            col_amax = tl.max(a, axis=0)
            row_at = rows * q_scale_stride + pid_c
            col_at = cols * qt_scale_stride + pid_r
        row_scale = scale_from_amax_tl(row_amax, FMT, POW2, HAS_UB, scale_ub)
        col_scale = scale_from_amax_tl(col_amax, FMT, POW2, HAS_UB, scale_ub)
        q = saturate_cast_tl(x, row_scale[:, None], FMT, SOFT_FP8, out_ty)
        qt = saturate_cast_tl(x, col_scale[None, :], FMT, SOFT_FP8, out_ty)
        if MODE == 2:
            _store_scales(q_amax_ptr, q_scale_ptr, q_inv_ptr, row_at, row_amax, row_scale, r_ok)
            _store_scales(qt_amax_ptr, qt_scale_ptr, qt_inv_ptr, col_at, col_amax, col_scale, c_ok)
        else:  # row scales are written by the first column of tiles, column scales by the first row
            if pid_c == 0:
                _store_scales(q_amax_ptr, q_scale_ptr, q_inv_ptr, row_at, row_amax, row_scale, r_ok)
            if pid_r == 0:
                _store_scales(
                    qt_amax_ptr, qt_scale_ptr, qt_inv_ptr, col_at, col_amax, col_scale, c_ok
                )
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[:, None] * R + rows[None, :], tl.trans(qt), mask=tl.trans(mask))


def _outputs(R: int, C: int, config: QuantConfig, device: torch.device) -> list[torch.Tensor]:
    """Empty data, amax, scale and inverse scale for q [R, C] then qt [C, R]."""
    made = []
    for rows, cols in ((R, C), (C, R)):
        shape = config.scale_shape(rows, cols)
        made.append(torch.empty((rows, cols), dtype=config.dtype, device=device))
        made += [torch.empty(shape, dtype=torch.float32, device=device) for _ in range(3)]
    return made


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
    return quantize_transpose_with(x, QuantConfig(fmt, granularity, block, pow2, scale_ub), amax)


def quantize_transpose_with(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """`quantize_transpose` with its options in a `QuantConfig`."""
    x = check_high_precision_2d(x)
    if amax is not None and config.granularity != "tensor":
        raise ValueError("a given amax (delayed scaling) applies to granularity 'tensor' only")
    R, C = x.shape
    amax_in = _check_amax(amax, (1,), x.device)
    require_triton_device(x)
    if x.numel() == 0:
        q = quantize_with(x, config, amax_in)
        return q, quantize_with(x.t(), config, amax_in)
    q, q_amax, q_scale, q_inv, qt, qt_amax, qt_scale, qt_inv = _outputs(R, C, config, x.device)
    soft = interpreting()
    if config.granularity == "block":
        mode = MODES["block1" if config.block[0] == 1 else "block128"]
        br = bc = 128
    else:
        mode = MODES[config.granularity]
        br, bc = (32, 32) if soft else (64, 64)
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
    warps = 8 if br * bc >= 8192 else 4
    amax_arg, col_amax_arg = q_amax, qt_amax
    if mode == MODES["tensor"]:
        # Both outputs share the one scale; q_amax receives the amax measured in x.
        qt_amax, qt_scale, qt_inv = q_amax, q_scale, q_inv
        q_amax.zero_()
        if amax_in is None:
            _amax_kernel[grid](
                x, q_amax, R, C, x.stride(0), x.stride(1), BLOCK_R=br, BLOCK_C=bc, num_warps=warps
            )
        else:
            amax_arg = amax_in
    elif mode == MODES["row"]:
        q_amax.zero_()
        qt_amax.zero_()
        _row_col_amax_kernel[grid](
            x, q_amax, qt_amax, R, C, x.stride(0), x.stride(1), BLOCK_R=br, BLOCK_C=bc, num_warps=warps
        )  # fmt: skip
    has_ub, ub = ub_args(config.scale_ub)
    _transpose_quantize_kernel[grid](
        x, q.view(torch.uint8) if soft else q, qt.view(torch.uint8) if soft else qt,
        amax_arg, col_amax_arg, q_amax, q_scale, q_inv, qt_amax, qt_scale, qt_inv,
        R, C, x.stride(0), x.stride(1), q_scale.stride(0), qt_scale.stride(0), ub,
        MODE=mode, FMT=FORMAT_IDS[config.fmt], SOFT_FP8=soft, POW2=config.pow2, HAS_UB=has_ub,
        RECORD_AMAX=amax_in is not None, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip
    g, blk = config.granularity, config.block
    return (
        Fp8Tensor(q, q_scale, q_inv, q_amax, config.fmt, g, blk),
        Fp8Tensor(qt, qt_scale, qt_inv, qt_amax, config.fmt, g, blk),
    )


def quantize_transpose_reference(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Pure torch: `quantize_reference` of x and of x^T."""
    return quantize_reference(x, config, amax), quantize_reference(x.t().contiguous(), config, amax)
