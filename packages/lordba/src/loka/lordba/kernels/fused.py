"""Fused LoRDBA forward: down-projection, rank scale and up-projection in one kernel.

    out[M, N] = addend + alpha * col_scale[N] * ((((x * in_scale) @ A^T) * rank_scale) @ B)

with ``A: [R, K]`` and ``B: [R, N]`` sign matrices packed along their long axis (``sign(A)``
and ``sign(B)^T`` as LoRDBA stores them). Each program owns ``BLOCK_M`` rows and one of
``SPLIT_N`` column ranges: it reduces its ``[BLOCK_M, R]`` rank activations over K in
registers, scales them, then sweeps its columns in ``BLOCK_N`` tiles, so the rank activations
never reach memory and the two sign-GEMMs cost one launch (the separate kernels write and
re-read ``t`` and launch twice: at 512 tokens their launch latency, not their work, is what
the adapter costs on the H200). ``SPLIT_N > 1`` buys parallelism for few tokens (512 tokens
are only 8 row blocks of 64 for 132 SMs) at the price of recomputing the down-projection,
i.e. reading ``x``'s rows once per column range (from L2 when they fit). Inference only: the
backward keeps the separate kernels, which need ``t``.

Not yet measured on a GPU (issue 19, item 3): the tiles below are a first guess, untuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import cdiv
from loka.lordba.kernels import _launch
from loka.lordba.kernels._tiles import mma, sign_down_rows, unpack_sign_tile
from loka.lordba.kernels.packing import unpack_signs


@triton.jit
def _sign_adapter_kernel(
    x_ptr,
    packed_a_ptr,
    packed_b_ptr,
    in_scale_ptr,
    rank_scale_ptr,
    col_scale_ptr,
    addend_ptr,
    out_ptr,
    M,
    K,
    N,
    R,
    alpha,
    stride_xm,
    stride_pa,
    stride_pb,
    stride_am,
    stride_an,
    stride_om,
    M_BUCKET,
    HAS_IN_SCALE: tl.constexpr,
    HAS_RANK_SCALE: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_N: tl.constexpr,  # the launch's column ranges (grid axis 1; read from the grid)
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    # Phase 1: t = (x * q) @ sign(A)^T over K, float32 in registers.
    t = sign_down_rows(
        x_ptr, packed_a_ptr, in_scale_ptr, rows, row_ok, ranks, K, R, stride_xm, stride_pa,
        HAS_IN_SCALE, INTERPRETER, BLOCK_M, BLOCK_C, BLOCK_R,
    )  # fmt: skip
    if HAS_RANK_SCALE:
        t = t * tl.load(rank_scale_ptr + ranks, mask=ranks < R, other=0.0).to(tl.float32)[None, :]
    t = t * alpha
    # Phase 2: out tile by tile over this program's columns (a whole number of BLOCK_N tiles,
    # so every tile starts on a byte of the packed signs); t stays in registers.
    splits = tl.num_programs(1)
    tiles = (N + BLOCK_N - 1) // BLOCK_N
    cols_per_split = (tiles + splits - 1) // splits * BLOCK_N
    n_start = tl.program_id(1) * cols_per_split
    n_end = tl.minimum(N, n_start + cols_per_split)
    for n0 in range(n_start, n_end, BLOCK_N):
        outs = n0 + tl.arange(0, BLOCK_N)
        out_ok = outs < N
        signs_b = unpack_sign_tile(packed_b_ptr, ranks, n0 // 8, stride_pb, R, N, BLOCK_R, BLOCK_N)
        acc = mma(t, signs_b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRETER)
        if HAS_COL_SCALE:
            acc = (
                acc * tl.load(col_scale_ptr + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
            )
        mask = row_ok[:, None] & out_ok[None, :]
        if HAS_ADDEND:
            acc += tl.load(
                addend_ptr + rows[:, None] * stride_am + outs[None, :] * stride_an,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
        tl.store(
            out_ptr + rows[:, None] * stride_om + outs[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


_sign_adapter_tuned = triton.autotune(
    configs=[
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_C": bc, "BLOCK_N": bn, "SPLIT_N": split},
            num_warps=w,
            num_stages=s,
        )
        for bm, bc, bn, split, w, s in [
            (32, 128, 128, 1, 4, 3),
            (64, 128, 128, 1, 4, 3),
            (64, 128, 256, 1, 8, 3),
            (128, 64, 128, 1, 8, 3),
            (32, 128, 128, 4, 4, 3),  # few tokens: more programs, x re-read per range
            (64, 128, 128, 8, 4, 3),
        ]
    ],
    key=["K", "N", "R", "M_BUCKET", "HAS_IN_SCALE", "HAS_ADDEND"],
)(_sign_adapter_kernel)
# Two column ranges under the interpreter, so the tests run the split path too.
_INTERPRETED = triton.Config({"BLOCK_M": 16, "BLOCK_C": 32, "BLOCK_N": 32, "SPLIT_N": 2})
_TARGET_PROGRAMS = 128  # about one per SM of an H100/H200 (132)


def _heuristic(rows: int, out_features: int) -> triton.Config:
    """The one tile without autotuning: 64 x 128 tiles, and as many column ranges as bring
    the grid near ``_TARGET_PROGRAMS`` programs when the row blocks alone do not."""
    block_m, block_n = 64, 128
    split = _TARGET_PROGRAMS // cdiv(rows, block_m)
    split = max(1, min(split, cdiv(out_features, block_n), 8))
    config = {"BLOCK_M": block_m, "BLOCK_C": 128, "BLOCK_N": block_n, "SPLIT_N": split}
    return triton.Config(config, num_warps=4)


def column_ranges(out_features: int, block_n: int, split_n: int) -> int:
    """How many column ranges the kernel gets for ``split_n`` asked: ranges of a whole number
    of ``block_n`` tiles each, as even as can be, none of them empty (the kernel gives range i
    the tiles ``[i * per, (i + 1) * per)``, ``per = cdiv(tiles, ranges)``)."""
    tiles = cdiv(out_features, block_n)
    if tiles == 0:
        return 1
    return cdiv(tiles, cdiv(tiles, max(1, min(split_n, tiles))))


def _grid(rows: int, out_features: int):
    """Row blocks x column ranges."""
    return lambda meta: (
        cdiv(rows, meta["BLOCK_M"]),
        column_ranges(out_features, meta["BLOCK_N"], meta["SPLIT_N"]),
    )


def _check_operands(x, packed_a, packed_b, out_features, in_scale, rank_scale, col_scale, addend):
    _launch.check_matrix(x, "x", (-1, -1))
    rank = _launch.packed_rank(packed_a)
    _launch.check_signs(packed_a, rank, x.shape[1], "packed_a")
    _launch.check_signs(packed_b, rank, out_features, "packed_b")
    _launch.check_vector(in_scale, "in_scale", x.shape[1])
    _launch.check_vector(rank_scale, "rank_scale", rank)
    _launch.check_vector(col_scale, "col_scale", out_features)
    if addend is not None:
        _launch.check_matrix(addend, "addend", (x.shape[0], out_features))
    return rank


def sign_adapter(
    x: torch.Tensor,
    packed_a: torch.Tensor,
    packed_b: torch.Tensor,
    out_features: int,
    *,
    in_scale: torch.Tensor | None = None,
    rank_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``addend + alpha * col_scale * (((x * in_scale) @ A^T * rank_scale) @ B)``, one kernel.

    ``packed_a``: ``uint8[R, ceil(K/8)]`` (sign(A)); ``packed_b``: ``uint8[R, ceil(N/8)]``
    (sign(B)^T). The result dtype is ``out_dtype``, else the addend's, else ``x``'s. The rank
    activations are float32; the up-projection dot is float32 (TF32 on the GPU).
    """
    rank = _check_operands(
        x, packed_a, packed_b, out_features, in_scale, rank_scale, col_scale, addend
    )
    rows, length = x.shape
    out_dtype = out_dtype or (addend.dtype if addend is not None else x.dtype)
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if rank == 0 or length == 0:
        return out.zero_() if addend is None else out.copy_(addend)
    x = _launch.unit_stride_rows(x)
    args = (
        x,
        packed_a,
        packed_b,
        x if in_scale is None else in_scale.contiguous(),
        x if rank_scale is None else rank_scale.contiguous(),
        x if col_scale is None else col_scale.contiguous(),
        x if addend is None else addend,
        out,
        rows,
        length,
        out_features,
        rank,
        float(alpha),
        x.stride(0),
        packed_a.stride(0),
        packed_b.stride(0),
        0 if addend is None else addend.stride(0),
        0 if addend is None else addend.stride(1),
        out.stride(0),
        _launch.m_bucket(rows),
    )
    _launch.launch(
        _sign_adapter_kernel,
        _sign_adapter_tuned,
        _grid(rows, out_features),
        args,
        device=x.device,
        interpreted=_INTERPRETED,
        heuristic=_heuristic(rows, out_features),
        HAS_IN_SCALE=in_scale is not None,
        HAS_RANK_SCALE=rank_scale is not None,
        HAS_COL_SCALE=col_scale is not None,
        HAS_ADDEND=addend is not None,
        BLOCK_R=_launch.rank_block(rank),
    )
    return out


def sign_adapter_reference(
    x: torch.Tensor,
    packed_a: torch.Tensor,
    packed_b: torch.Tensor,
    out_features: int,
    *,
    in_scale: torch.Tensor | None = None,
    rank_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`sign_adapter` (float32 arithmetic, one rounding to ``out_dtype``)."""
    _check_operands(x, packed_a, packed_b, out_features, in_scale, rank_scale, col_scale, addend)
    out_dtype = out_dtype or (addend.dtype if addend is not None else x.dtype)
    scaled = x.float() if in_scale is None else x.float() * in_scale.float()
    t = scaled @ unpack_signs(packed_a, x.shape[1]).T
    if rank_scale is not None:
        t = t * rank_scale.float()
    result = (t @ unpack_signs(packed_b, out_features)) * alpha
    if col_scale is not None:
        result = result * col_scale.float()
    if addend is not None:
        result = result + addend.float()
    return result.to(out_dtype)
