"""Sign down-projection: ``out[M, R] = (x[M, C] * col_scale[C]) @ S[R, C]^T`` with S packed.

LoRDBA uses it for the adapter's first factor in the forward (``t = (x * q) @ sign(A)^T``)
and for the second factor's transpose in the backward (``(dY * s p) @ sign(B)``). The reduction
runs over the long axis C; each program owns ``BLOCK_M`` rows, unpacks an ``[R, BLOCK_C]`` sign
tile per step in registers and folds ``col_scale`` into it (R x BLOCK_C multiplies instead of
BLOCK_M x BLOCK_C), so the only large traffic is one read of ``x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import cdiv
from loka.lordba.kernels import _launch
from loka.lordba.kernels._tiles import sign_down_rows
from loka.lordba.kernels.packing import unpack_signs


@triton.jit
def _sign_down_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    out_ptr,
    M,
    C,
    R,
    stride_xm,
    stride_pr,
    stride_om,
    M_BUCKET,
    HAS_SCALE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # int64 rows: row * stride passes 2**31 elements on large activations.
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    acc = sign_down_rows(
        x_ptr, packed_ptr, scale_ptr, rows, row_ok, ranks, C, R, stride_xm, stride_pr,
        HAS_SCALE, INTERPRETER, BLOCK_M, BLOCK_C, BLOCK_R,
    )  # fmt: skip
    tl.store(
        out_ptr + rows[:, None] * stride_om + ranks[None, :],
        acc,
        mask=row_ok[:, None] & (ranks < R)[None, :],
    )


_sign_down_tuned = triton.autotune(
    # Memory-bound on x: few rows per program for small M (more programs), deep pipelines.
    configs=_launch.tuning_configs(
        [
            (16, 256, 4, 4),
            (32, 128, 4, 4),
            (32, 256, 4, 3),
            (64, 128, 4, 3),
            (64, 256, 8, 3),
            (128, 128, 8, 3),
        ]
    ),
    key=["C", "R", "M_BUCKET", "HAS_SCALE"],
)(_sign_down_kernel)
_INTERPRETED = triton.Config({"BLOCK_M": 16, "BLOCK_C": 32})
_HEURISTIC = triton.Config({"BLOCK_M": 64, "BLOCK_C": 128}, num_warps=4, num_stages=4)


def _check_down_operands(x, packed, col_scale) -> int:
    _launch.check_matrix(x, "x", (-1, -1))
    rank = _launch.packed_rank(packed)
    _launch.check_signs(packed, rank, x.shape[1], "packed signs")
    _launch.check_vector(col_scale, "col_scale", x.shape[1])
    return rank


def sign_down(
    x: torch.Tensor, packed: torch.Tensor, col_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x * col_scale) @ S^T`` in float32, ``x: [M, C]``, ``packed: uint8[R, ceil(C/8)]``.

    ``col_scale`` (``[C]``, optional) scales the reduction axis. Dot operands use ``x``'s
    dtype (bf16/fp16 tensor cores; fp32 runs as TF32 on the GPU), accumulation is float32.
    """
    rank = _check_down_operands(x, packed, col_scale)
    rows, length = x.shape
    out = torch.empty((rows, rank), dtype=torch.float32, device=x.device)
    if rows == 0 or rank == 0 or length == 0:
        return out.zero_()
    x = _launch.unit_stride_rows(x)
    args = (
        x,
        packed,
        x if col_scale is None else col_scale.contiguous(),
        out,
        rows,
        length,
        rank,
        x.stride(0),
        packed.stride(0),
        out.stride(0),
        _launch.m_bucket(rows),
    )
    _launch.launch(
        _sign_down_kernel,
        _sign_down_tuned,
        lambda meta: (cdiv(rows, meta["BLOCK_M"]),),
        args,
        device=x.device,
        interpreted=_INTERPRETED,
        heuristic=_HEURISTIC,
        HAS_SCALE=col_scale is not None,
        BLOCK_R=_launch.rank_block(rank),
    )
    return out


def sign_down_reference(
    x: torch.Tensor, packed: torch.Tensor, col_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch :func:`sign_down` in float32."""
    _check_down_operands(x, packed, col_scale)
    scaled = x.float() if col_scale is None else x.float() * col_scale.float()
    return scaled @ unpack_signs(packed, x.shape[1]).T
