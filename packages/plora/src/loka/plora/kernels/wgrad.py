"""Wgrad: `out_i = s? * left_i^T @ right_i`, summed over adapter i's own tokens only.

Tiled over the output, looping over the adapter's tokens, so adapter i's gradient never sums
another adapter's tokens: `dA_i = dh_i^T x_i` (rank on the left) and `dB_i = s_i dy_i^T h_i`
(rank on the right), each landing at the adapter's rank offset of the concatenated gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import load_adapter, load_tile, mma, store_tile
from loka.plora.kernels.layout import MultiLoraLayout


@triton.jit
def _wgrad_kernel(
    left_ptr, right_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, P, Q, stride_lt, stride_lp,
    stride_rt, stride_rq, stride_op, stride_oq,
    RANK_ON_LEFT: tl.constexpr, SCALED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    pid_q = tl.program_id(1)
    adapter = tl.program_id(2)
    start, end, rank, rank_offset = load_adapter(meta_ptr, num_adapters, adapter)
    # The rank side of the product is limited by this adapter's rank and lands at its
    # rank offset in the concatenated gradient; the other side spans the full dimension.
    if RANK_ON_LEFT:
        p_limit = rank
        q_limit = Q
        out_base = rank_offset.to(tl.int64) * stride_op
    else:
        p_limit = P
        q_limit = rank
        out_base = rank_offset.to(tl.int64) * stride_oq
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if pid_p * BLOCK_P >= p_limit:
        return
    if pid_q * BLOCK_Q >= q_limit:
        return
    mask_p = offs_p < p_limit
    mask_q = offs_q < q_limit
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t < end
        lhs = load_tile(left_ptr, offs_p, offs_t, stride_lp, stride_lt, mask_p, mask_t)
        rhs = load_tile(right_ptr, offs_t, offs_q, stride_rt, stride_rq, mask_t, mask_q)
        acc = mma(lhs, rhs, acc, INTERPRETER)
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    store_tile(out_ptr + out_base, acc, offs_p, offs_q, stride_op, stride_oq, mask_p, mask_q)


_WGRAD_CONFIGS = [
    triton.Config({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 64, "BLOCK_Q": 128, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 128, "BLOCK_Q": 64, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 32, "BLOCK_Q": 128, "BLOCK_T": 128}, num_warps=4, num_stages=3),
]
_WGRAD = _launch.autotuned(_wgrad_kernel, _WGRAD_CONFIGS, key=["P", "Q", "RANK_ON_LEFT", "SCALED"])
_WGRAD_INTERPRETED = triton.Config({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_T": 32})


def lora_wgrad(
    left: torch.Tensor,
    right: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    rank_on_left: bool,
    scaled: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-adapter `left_i^T @ right_i` over adapter i's tokens, concatenated along rank.

    `rank_on_left=True` (dA): left `[T, >= max_rank]` (dh), right `[T, K]` (x); returns
    `[sum r, K]`. `rank_on_left=False` (dB): left `[T, N]` (dy), right `[T, >= max_rank]`
    (h); returns `[N, sum r]`. Adapters with no tokens get zeros.
    """
    _launch.check_operands("lora_wgrad", layout, left, right)
    if left.shape[0] != layout.num_tokens or right.shape[0] != layout.num_tokens:
        raise ValueError(
            f"lora_wgrad: left has {left.shape[0]} and right {right.shape[0]} tokens, "
            f"layout {layout.num_tokens}"
        )
    rank_side = left if rank_on_left else right
    if rank_side.shape[1] < layout.max_rank:
        raise ValueError(
            f"lora_wgrad: rank operand has {rank_side.shape[1]} columns < max rank {layout.max_rank}"
        )
    if rank_on_left:
        p, q = layout.max_rank, right.shape[1]
        out_shape = (layout.total_rank, q)
    else:
        p, q = left.shape[1], layout.max_rank
        out_shape = (p, layout.total_rank)
    out = torch.empty(out_shape, device=left.device, dtype=out_dtype or left.dtype)

    def grid(meta):
        return (
            triton.cdiv(p, meta["BLOCK_P"]),
            triton.cdiv(q, meta["BLOCK_Q"]),
            layout.num_adapters,
        )

    _launch.launch(
        _WGRAD,
        left.device,
        grid,
        (_WGRAD_INTERPRETED, _WGRAD_CONFIGS[0]),
        (left, right, out, layout.meta, layout.scale_tensor, layout.num_adapters, p, q,
         *left.stride(), *right.stride(), *out.stride()),
        RANK_ON_LEFT=rank_on_left,
        SCALED=scaled,
    )  # fmt: skip
    return out


def lora_wgrad_reference(
    left: torch.Tensor,
    right: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    rank_on_left: bool,
    scaled: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if rank_on_left:
        out = torch.zeros(layout.total_rank, right.shape[1], device=left.device)
    else:
        out = torch.zeros(left.shape[1], layout.total_rank, device=left.device)
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        lhs = left[s:e, :r] if rank_on_left else left[s:e]
        rhs = right[s:e] if rank_on_left else right[s:e, :r]
        grad = lhs.float().t() @ rhs.float()
        if scaled:
            grad = grad * layout.scales[i]
        if rank_on_left:
            out[o : o + r] = grad
        else:
            out[:, o : o + r] = grad
    return out.to(out_dtype or left.dtype)
