"""Sign up-projection: ``out[M, C] = addend + alpha * col_scale * ((left * row_scale) @ S)``.

``left: [M, R]``, ``S: [R, C]`` packed, ``row_scale: [R]``, ``col_scale: [C]``. LoRDBA uses it
for the adapter's second factor in the forward (``y + s * p * ((t * m) @ sign(B)^T)``, the base
output as ``addend``) and for the input gradient in the backward
(``q * ((dU * m) @ sign(A))``). The reduction is over the rank only, so each program writes one
``[BLOCK_M, BLOCK_C]`` output tile from a ``[BLOCK_M, R]`` and an ``[R, BLOCK_C]`` tile: the
cost is the output write plus the ``addend`` read, and fusing the add saves a separate pass.
``addend`` may be a broadcast view (row stride 0), e.g. a bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import cdiv
from loka.lordba.kernels import _launch
from loka.lordba.kernels._tiles import mma, unpack_sign_tile
from loka.lordba.kernels.packing import unpack_signs
from loka.mods.dtypes import cast


@triton.jit
def _sign_up_kernel(
    left_ptr,
    packed_ptr,
    row_scale_ptr,
    col_scale_ptr,
    addend_ptr,
    out_ptr,
    M,
    C,
    R,
    alpha,
    stride_lm,
    stride_pr,
    stride_am,
    stride_ac,
    stride_om,
    M_BUCKET,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c_start = tl.program_id(1) * BLOCK_C
    cols = c_start + tl.arange(0, BLOCK_C)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    col_ok = cols < C
    rank_ok = ranks < R
    left = tl.load(
        left_ptr + rows[:, None] * stride_lm + ranks[None, :],
        mask=row_ok[:, None] & rank_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_ROW_SCALE:
        row_scale = tl.load(row_scale_ptr + ranks, mask=rank_ok, other=0.0).to(tl.float32)
        left = left * row_scale[None, :]
    signs = unpack_sign_tile(packed_ptr, ranks, c_start // 8, stride_pr, R, C, BLOCK_R, BLOCK_C)
    # float32 operands: TF32 tensor cores on the GPU; K = rank, so precision costs nothing.
    acc = mma(left, signs, tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32), INTERPRETER) * alpha
    if HAS_COL_SCALE:
        acc = acc * tl.load(col_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_ADDEND:
        addend = tl.load(
            addend_ptr + rows[:, None] * stride_am + cols[None, :] * stride_ac, mask=mask, other=0.0
        )
        acc = acc + addend.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


_sign_up_tuned = triton.autotune(
    # No loop (K = rank): big output tiles, one stage.
    configs=_launch.tuning_configs(
        [(32, 256, 4, 1), (64, 128, 4, 1), (64, 256, 8, 1), (128, 128, 8, 1), (128, 256, 8, 1)]
    ),
    key=["C", "R", "M_BUCKET", "HAS_ADDEND"],
)(_sign_up_kernel)
_INTERPRETED = triton.Config({"BLOCK_M": 16, "BLOCK_C": 32})
_HEURISTIC = triton.Config({"BLOCK_M": 64, "BLOCK_C": 128}, num_warps=4, num_stages=1)


def _check_up_operands(left, packed, length, row_scale, col_scale, addend):
    _launch.check_matrix(left, "left", (-1, -1))
    rows, rank = left.shape
    _launch.check_signs(packed, rank, length, "packed signs")
    _launch.check_vector(row_scale, "row_scale", rank)
    _launch.check_vector(col_scale, "col_scale", length)
    if addend is not None:
        _launch.check_matrix(addend, "addend", (rows, length))
    return rows, rank


def sign_up(
    left: torch.Tensor,
    packed: torch.Tensor,
    length: int,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``addend + alpha * col_scale * ((left * row_scale) @ S)`` as an ``[M, length]`` tensor.

    ``packed`` is ``uint8[R, ceil(length/8)]``. The result dtype is ``out_dtype``, else the
    addend's, else ``left``'s. Arithmetic is float32 (TF32 dot on the GPU), rounded once.
    """
    rows, rank = _check_up_operands(left, packed, length, row_scale, col_scale, addend)
    out_dtype = out_dtype or (addend.dtype if addend is not None else left.dtype)
    out = torch.empty((rows, length), dtype=out_dtype, device=left.device)
    if rows == 0 or length == 0:
        return out
    if rank == 0:
        return out.zero_() if addend is None else out.copy_(addend)
    left = _launch.unit_stride_rows(left)
    args = (
        left,
        packed,
        left if row_scale is None else row_scale.contiguous(),
        left if col_scale is None else col_scale.contiguous(),
        left if addend is None else addend,
        out,
        rows,
        length,
        rank,
        float(alpha),
        left.stride(0),
        packed.stride(0),
        0 if addend is None else addend.stride(0),
        0 if addend is None else addend.stride(1),
        out.stride(0),
        _launch.m_bucket(rows),
    )
    _launch.launch(
        _sign_up_kernel,
        _sign_up_tuned,
        lambda meta: (cdiv(rows, meta["BLOCK_M"]), cdiv(length, meta["BLOCK_C"])),
        args,
        device=left.device,
        interpreted=_INTERPRETED,
        heuristic=_HEURISTIC,
        HAS_ROW_SCALE=row_scale is not None,
        HAS_COL_SCALE=col_scale is not None,
        HAS_ADDEND=addend is not None,
        BLOCK_R=_launch.rank_block(rank),
    )
    return out


def sign_up_reference(
    left: torch.Tensor,
    packed: torch.Tensor,
    length: int,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`sign_up` (float32 arithmetic, one rounding to ``out_dtype``)."""
    _check_up_operands(left, packed, length, row_scale, col_scale, addend)
    out_dtype = out_dtype or (addend.dtype if addend is not None else left.dtype)
    scaled = left.float() if row_scale is None else left.float() * row_scale.float()
    result = (scaled @ unpack_signs(packed, length)) * alpha
    if col_scale is not None:
        result = result * col_scale.float()
    if addend is not None:
        result = result + addend.float()
    # `cast`, not `.to`: LoRDBAFunction returns this tensor, and a no-op `.to` there zeroes
    # every gradient under torch.compile (torch 2.11; `loka.mods.dtypes.cast`).
    return cast(result, out_dtype)
