"""FP8 quantization: tensorwise, rowwise, and 1x128 / 128x128 blockwise.

Kernels: `_amax_kernel` + `_quantize_tensor_kernel` (two phases: the amax, then one read
that quantizes; with a given amax, the delayed-scaling case, only the second), and
`_quantize_groups_kernel` for rows and blocks (one read: a row or block is held in registers
while its amax, scale and FP8 values are computed). `quantize` launches them;
`quantize_reference` is the pure-torch definition they must match byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.formats import QuantConfig, check_high_precision_2d, scale_grid
from loka.kernels.fp8_bits import FORMAT_IDS
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.runtime import interpreting, require_triton_device
from loka.kernels.scaling import (
    finite_abs,
    finite_abs_tl,
    inverse_tl,
    saturate_cast,
    saturate_cast_tl,
    scale_from_amax,
    scale_from_amax_tl,
    ub_args,
)

# Rows up to this many elements are quantized from registers in one read.
MAX_ROW_IN_REGISTERS = 16384


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0))


@triton.jit
def _quantize_tensor_kernel(
    x_ptr, q_ptr, amax_in_ptr, amax_seen_ptr, scale_ptr, inv_ptr,
    R, C, stride_r, stride_c, scale_ub,
    FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr,
    RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    scale = scale_from_amax_tl(tl.load(amax_in_ptr), FMT, POW2, HAS_UB, scale_ub)
    q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if RECORD_AMAX:
        tl.atomic_max(amax_seen_ptr, tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
        tl.store(inv_ptr, inverse_tl(scale))


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, amax_in_ptr, amax_ptr, scale_ptr, inv_ptr,
    R, C, stride_r, stride_c, scale_stride_r, scale_ub,
    FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr, HAS_AMAX_IN: tl.constexpr,
    WHOLE_TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOOP_C: tl.constexpr,
):  # fmt: skip
    """One scale per row of the tile (rows, 1x128 blocks) or per tile (128x128 blocks).

    Program (i, j) covers rows [i*BLOCK_R, ...) and columns [j*BLOCK_C, ...); the scale of its
    group sits at scale[i*BLOCK_R + r, j] (per row) or scale[i, j] (WHOLE_TILE). A row longer
    than the registers hold (LOOP_C) is read twice, once for its amax and once to quantize.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    if LOOP_C:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = row_ok[:, None] & (cols[None, :] < C)
            x = tl.load(
                x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0
            )
            amax = tl.maximum(amax, tl.max(finite_abs_tl(x), axis=1))
        if HAS_AMAX_IN:
            scale = scale_from_amax_tl(
                tl.load(amax_in_ptr + rows, mask=row_ok, other=0.0), FMT, POW2, HAS_UB, scale_ub
            )
        else:
            scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = row_ok[:, None] & (cols[None, :] < C)
            x = tl.load(
                x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0
            )
            q = saturate_cast_tl(x, scale[:, None], FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m)
        tl.store(amax_ptr + rows, amax, mask=row_ok)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        tl.store(inv_ptr + rows, inverse_tl(scale), mask=row_ok)
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
        if WHOLE_TILE:
            amax = tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0)
            at = pid_r * scale_stride_r + pid_c
            if HAS_AMAX_IN:
                scale = scale_from_amax_tl(tl.load(amax_in_ptr + at), FMT, POW2, HAS_UB, scale_ub)
            else:
                scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
            q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            tl.store(amax_ptr + at, amax)
            tl.store(scale_ptr + at, scale)
            tl.store(inv_ptr + at, inverse_tl(scale))
        else:
            amax = tl.max(finite_abs_tl(x), axis=1)
            at = rows * scale_stride_r + pid_c
            if HAS_AMAX_IN:
                scale = scale_from_amax_tl(
                    tl.load(amax_in_ptr + at, mask=row_ok, other=0.0), FMT, POW2, HAS_UB, scale_ub
                )
            else:
                scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
            q = saturate_cast_tl(x, scale[:, None], FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            tl.store(amax_ptr + at, amax, mask=row_ok)
            tl.store(scale_ptr + at, scale, mask=row_ok)
            tl.store(inv_ptr + at, inverse_tl(scale), mask=row_ok)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m)


def _num_warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _tile(R: int, C: int, target: int) -> tuple[int, int]:
    """A [BLOCK_R, BLOCK_C] tile of about `target` elements covering whole rows when it can."""
    block_c = min(triton.next_power_of_2(max(C, 1)), target)
    block_r = min(triton.next_power_of_2(max(R, 1)), max(1, target // block_c))
    return block_r, block_c


def _check_amax(
    amax: torch.Tensor | None, shape: tuple, device: torch.device
) -> torch.Tensor | None:
    if amax is None:
        return None
    if not isinstance(amax, torch.Tensor):
        raise TypeError(
            f"amax must be a float32 tensor of shape {shape}, got {type(amax).__name__}"
        )
    if amax.dtype != torch.float32 or tuple(amax.shape) != tuple(shape) or amax.device != device:
        raise ValueError(
            f"amax must be a float32 tensor of shape {shape} on {device}, "
            f"got {amax.dtype} {tuple(amax.shape)} on {amax.device}"
        )
    return amax.contiguous()


def quantize(
    x: torch.Tensor,
    fmt: str = "e4m3",
    granularity: str = "row",
    *,
    block: tuple[int, int] | None = None,
    pow2: bool = False,
    scale_ub: float | None = None,
    amax: torch.Tensor | None = None,
) -> Fp8Tensor:
    """Quantize a 2-D bf16/fp16/fp32 tensor to FP8 with one scale per tensor, row or block.

    `block` is (1, 128) (default for 'block') or (128, 128). `amax`, shaped like the scales,
    replaces the measured amax when computing the scale (delayed scaling); the returned
    ``Fp8Tensor.amax`` is always the amax measured in `x`. Strided `x` is read in place.
    """
    return quantize_with(x, QuantConfig(fmt, granularity, block, pow2, scale_ub), amax)


def quantize_with(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> Fp8Tensor:
    """`quantize` with its options in a `QuantConfig` (what modules keep per operand)."""
    x = check_high_precision_2d(x)
    fmt, granularity, block = config.fmt, config.granularity, config.block
    R, C = x.shape
    grid_shape = config.scale_shape(R, C)
    amax_in = _check_amax(amax, grid_shape, x.device)
    require_triton_device(x)
    q = torch.empty((R, C), dtype=config.dtype, device=x.device)
    scale = torch.empty(grid_shape, dtype=torch.float32, device=x.device)
    inv = torch.empty_like(scale)
    has_ub, ub = ub_args(config.scale_ub)
    pow2 = config.pow2
    soft = interpreting()
    q_out = q.view(torch.uint8) if soft else q
    if granularity == "tensor":
        seen = torch.zeros(1, dtype=torch.float32, device=x.device)
        if x.numel() == 0:
            scale.copy_(
                scale_from_amax(seen if amax_in is None else amax_in, fmt, pow2, config.scale_ub)
            )
            inv.copy_(1.0 / scale)
            return Fp8Tensor(q, scale, inv, seen, fmt, granularity)
        br, bc = _tile(R, C, 1024 if interpreting() else 4096)
        grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
        if amax_in is None:
            _amax_kernel[grid](
                x,
                seen,
                R,
                C,
                x.stride(0),
                x.stride(1),
                BLOCK_R=br,
                BLOCK_C=bc,
                num_warps=_num_warps(br * bc),
            )
        _quantize_tensor_kernel[grid](
            x, q_out, seen if amax_in is None else amax_in, seen, scale, inv,
            R, C, x.stride(0), x.stride(1), ub,
            FMT=FORMAT_IDS[fmt], SOFT_FP8=soft, POW2=pow2, HAS_UB=has_ub, RECORD_AMAX=amax_in is not None,
            BLOCK_R=br, BLOCK_C=bc, num_warps=_num_warps(br * bc),
        )  # fmt: skip
        return Fp8Tensor(q, scale, inv, seen, fmt, granularity)

    seen = torch.empty_like(scale)
    if q.numel() == 0:
        seen.zero_()
        scale.copy_(
            scale_from_amax(seen if amax_in is None else amax_in, fmt, pow2, config.scale_ub)
        )
        inv.copy_(1.0 / scale)
        return Fp8Tensor(q, scale, inv, seen, fmt, granularity, block)
    if granularity == "row":
        loop_c = C > MAX_ROW_IN_REGISTERS
        br, bc = _tile(R, C, 4096 if loop_c else max(4096, triton.next_power_of_2(C)))
        grid, whole, scale_stride = (triton.cdiv(R, br), 1), False, 1
    else:
        block_r, bc = block
        loop_c = False
        whole = block_r > 1
        br = block_r if whole else _tile(R, bc, 4096)[0]
        grid, scale_stride = (triton.cdiv(R, br), triton.cdiv(C, bc)), grid_shape[1]
    _quantize_groups_kernel[grid](
        x, q_out, seen if amax_in is None else amax_in, seen, scale, inv,
        R, C, x.stride(0), x.stride(1), scale_stride, ub,
        FMT=FORMAT_IDS[fmt], SOFT_FP8=soft, POW2=pow2, HAS_UB=has_ub, HAS_AMAX_IN=amax_in is not None,
        WHOLE_TILE=whole, BLOCK_R=br, BLOCK_C=bc, LOOP_C=loop_c, num_warps=_num_warps(br * bc),
    )  # fmt: skip
    return Fp8Tensor(q, scale, inv, seen, fmt, granularity, block)


def group_amax(x: torch.Tensor, granularity: str, block: tuple[int, int] | None) -> torch.Tensor:
    """Reference: the amax of each scale group of `x` (NaN and Inf ignored), float32."""
    a = finite_abs(x)
    R, C = x.shape
    if granularity == "tensor":
        return a.amax().reshape(1) if a.numel() else torch.zeros(1, device=x.device)
    if granularity == "row":
        return a.amax(dim=1) if C else torch.zeros(R, device=x.device)
    br, bc = block
    gr, gc = scale_grid(R, C, granularity, block)
    padded = torch.zeros(gr * br, gc * bc, device=x.device)
    padded[:R, :C] = a
    return padded.view(gr, br, gc, bc).amax(dim=(1, 3))


def quantize_reference(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> Fp8Tensor:
    """Pure-torch `quantize_with`: the definition the kernels are tested against."""
    x = check_high_precision_2d(x)
    fmt, granularity, block = config.fmt, config.granularity, config.block
    seen = group_amax(x, granularity, block)
    amax_in = _check_amax(amax, tuple(seen.shape), x.device)
    scale = scale_from_amax(seen if amax_in is None else amax_in, fmt, config.pow2, config.scale_ub)
    shell = Fp8Tensor(
        torch.empty(x.shape, dtype=config.dtype, device=x.device),
        scale,
        1.0 / scale,
        seen,
        fmt,
        granularity,
        block,
    )
    q = saturate_cast(x, shell.expand_scale(), fmt)
    return Fp8Tensor(q, scale, 1.0 / scale, seen, fmt, granularity, block)
