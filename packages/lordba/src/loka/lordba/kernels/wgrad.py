"""Sign weight gradient: the straight-through gradients of a scaled sign factor.

For a factor used as ``(right-side input * col_scale) @ S^T`` with ``S = sign(latent)``,
``latent: [R, C]``, and a token-axis product ``W = alpha * left^T @ right`` (``left: [M, R]``,
``right: [M, C]``):

* ``latent_grad = W * col_scale * [|latent| <= clip]`` -- the clipped straight-through
  estimator: the sign's gradient is passed to the latent where ``|latent| <= clip``, blocked
  where the latent has saturated (``clip = inf`` gives the plain estimator);
* ``col_scale_grad[c] = sum_r W[r, c] * S[r, c]`` -- the exact gradient of the channel scale.

LoRDBA calls it with ``(left, right) = (dU * m, x)`` for A (col_scale = q) and with
``(t * m, dY)``, ``alpha = s`` for B (col_scale = p, latent = B's transpose view).

Two kernels: a split-M tall-skinny GEMM writing float32 partials ``[SPLIT, R, C]`` (M is
large and R x C small, so splitting M is what fills the GPU), then a finalize kernel that sums
the partials and fuses the sign, the gate and both scalings, reading the latent once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import cdiv
from loka.lordba.kernels import _launch
from loka.lordba.kernels._tiles import mma


@triton.jit
def _wgrad_partial_kernel(
    left_ptr,
    right_ptr,
    partial_ptr,
    M,
    C,
    R,
    SPLIT,
    stride_lm,
    stride_rm,
    stride_ps,
    stride_pr,
    M_BUCKET,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    col_ok = cols < C
    rank_ok = ranks < R
    rows_per_split = tl.cdiv(tl.cdiv(M, SPLIT), BLOCK_M) * BLOCK_M
    m_start = split * rows_per_split
    m_end = tl.minimum(M, m_start + rows_per_split)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < m_end
        right = tl.load(
            right_ptr + rows[:, None] * stride_rm + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        left = tl.load(
            left_ptr + rows[:, None] * stride_lm + ranks[None, :],
            mask=row_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )
        acc = mma(tl.trans(left.to(right.dtype)), right, acc, INTERPRETER)
    tl.store(
        partial_ptr + split * stride_ps + ranks[:, None] * stride_pr + cols[None, :],
        acc,
        mask=rank_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _wgrad_finalize_kernel(
    partial_ptr,
    latent_ptr,
    col_scale_ptr,
    latent_grad_ptr,
    col_grad_ptr,
    C,
    R,
    SPLIT,
    alpha,
    clip,
    stride_ps,
    stride_pr,
    stride_lr,
    stride_lc,
    stride_gr,
    stride_gc,
    HAS_COL_SCALE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ranks = tl.arange(0, BLOCK_R)
    col_ok = cols < C
    tile_ok = (ranks < R)[:, None] & col_ok[None, :]
    offsets = ranks[:, None] * stride_pr + cols[None, :]
    grad = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for split in range(0, SPLIT):
        grad += tl.load(partial_ptr + split * stride_ps + offsets, mask=tile_ok, other=0.0)
    grad = grad * alpha
    latent = tl.load(
        latent_ptr + ranks[:, None] * stride_lr + cols[None, :] * stride_lc, mask=tile_ok, other=0.0
    ).to(tl.float32)
    passes = tl.abs(latent) <= clip
    if HAS_COL_SCALE:
        signs = tl.where(latent < 0, -1.0, 1.0)
        col_grad = tl.sum(tl.where(tile_ok, grad * signs, 0.0), axis=0)
        tl.store(col_grad_ptr + cols, col_grad, mask=col_ok)
        scale = tl.load(col_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        grad = grad * scale[None, :]
    tl.store(
        latent_grad_ptr + ranks[:, None] * stride_gr + cols[None, :] * stride_gc,
        tl.where(passes, grad, 0.0).to(latent_grad_ptr.dtype.element_ty),
        mask=tile_ok,
    )


_wgrad_partial_tuned = triton.autotune(
    configs=_launch.tuning_configs(
        [(32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
    ),
    key=["C", "R", "M_BUCKET", "SPLIT"],
)(_wgrad_partial_kernel)
_INTERPRETED = triton.Config({"BLOCK_M": 16, "BLOCK_C": 32})
_HEURISTIC = triton.Config({"BLOCK_M": 64, "BLOCK_C": 128}, num_warps=4, num_stages=3)

# Column block assumed when sizing the split (the autotuner may pick another; this only
# sets how many partial sums there are).
_SPLIT_SIZING_BLOCK_C = 128
_MIN_ROWS_PER_SPLIT = 256


def _check_wgrad_operands(left, right, latent, col_scale):
    _launch.check_matrix(left, "left", (-1, -1))
    rows, rank = left.shape
    _launch.check_matrix(right, "right", (rows, -1))
    length = right.shape[1]
    _launch.check_matrix(latent, "latent", (rank, length))
    _launch.check_vector(col_scale, "col_scale", length)
    return rows, rank, length


def _default_split(rows: int, length: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(2, max(1, rows))
    programs = torch.cuda.get_device_properties(device).multi_processor_count * 2
    column_blocks = cdiv(length, _SPLIT_SIZING_BLOCK_C)
    return max(1, min(cdiv(programs, column_blocks), rows // _MIN_ROWS_PER_SPLIT))


def sign_wgrad(
    left: torch.Tensor,
    right: torch.Tensor,
    latent: torch.Tensor,
    *,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    clip: float = math.inf,
    split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Straight-through ``(latent_grad, col_scale_grad)`` of a scaled sign factor.

    ``latent_grad`` has ``latent``'s shape, dtype and strides (pass a transposed view and get
    a transposed gradient); ``col_scale_grad`` is float32 ``[C]``, or None without a
    ``col_scale``. ``split`` overrides how many partial sums the token axis is cut into.
    """
    rows, rank, length = _check_wgrad_operands(left, right, latent, col_scale)
    latent_grad = torch.empty_strided(
        latent.shape, latent.stride(), dtype=latent.dtype, device=latent.device
    )
    col_grad = None
    if col_scale is not None:
        col_grad = torch.empty(length, dtype=torch.float32, device=left.device)
    if rank == 0 or length == 0:
        return latent_grad, col_grad
    split = split or _default_split(rows, length, left.device)
    left = _launch.unit_stride_rows(left)
    right = _launch.unit_stride_rows(right)
    partial = torch.empty((split, rank, length), dtype=torch.float32, device=left.device)
    block_r = _launch.rank_block(rank)
    args = (left, right, partial, rows, length, rank, split, left.stride(0), right.stride(0))
    args += (partial.stride(0), partial.stride(1), _launch.m_bucket(rows))
    _launch.launch(
        _wgrad_partial_kernel,
        _wgrad_partial_tuned,
        lambda meta: (cdiv(length, meta["BLOCK_C"]), split),
        args,
        device=left.device,
        interpreted=_INTERPRETED,
        heuristic=_HEURISTIC,
        BLOCK_R=block_r,
    )
    block_c = 128 if left.device.type == "cuda" else 32
    _wgrad_finalize_kernel[(cdiv(length, block_c),)](
        partial,
        latent,
        latent if col_scale is None else col_scale.contiguous(),
        latent_grad,
        latent if col_grad is None else col_grad,
        length,
        rank,
        split,
        float(alpha),
        float(clip),
        partial.stride(0),
        partial.stride(1),
        latent.stride(0),
        latent.stride(1),
        latent_grad.stride(0),
        latent_grad.stride(1),
        HAS_COL_SCALE=col_scale is not None,
        BLOCK_C=block_c,
        BLOCK_R=block_r,
    )
    return latent_grad, col_grad


def sign_wgrad_reference(
    left: torch.Tensor,
    right: torch.Tensor,
    latent: torch.Tensor,
    *,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    clip: float = math.inf,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch :func:`sign_wgrad` in float32."""
    _check_wgrad_operands(left, right, latent, col_scale)
    grad = (left.float().T @ right.float()) * alpha
    latent32 = latent.float()
    col_grad = None
    if col_scale is not None:
        signs = torch.where(latent32 < 0, -1.0, 1.0)
        col_grad = (grad * signs).sum(dim=0)
        grad = grad * col_scale.float()
    grad = torch.where(latent32.abs() <= clip, grad, torch.zeros_like(grad))
    latent_grad = torch.empty_strided(
        latent.shape, latent.stride(), dtype=latent.dtype, device=latent.device
    )
    return latent_grad.copy_(grad), col_grad
