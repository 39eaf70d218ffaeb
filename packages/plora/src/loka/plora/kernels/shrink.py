"""Shrink: `h[t, :r_i] = s? * x[t] @ W_i^T`, W_i the rows of `weight` owned by adapter i.

Tiled over tokens and rank, looping over K. The forward's `x A_i^T`; in the backward,
`dh = s_i dy B_i` (`weight` = `b_cat.t()`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import rank_product, store_tile, token_block
from loka.plora.kernels.layout import MultiLoraLayout


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, K, R_OUT, stride_xt, stride_xk,
    stride_wr, stride_wk, stride_ot, stride_or,
    SCALED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_r = tl.program_id(1)
    adapter = tl.program_id(2)
    t0, end, offs_t, mask_t, rank, rank_offset = token_block(
        meta_ptr, num_adapters, adapter, pid_t, BLOCK_T
    )
    if t0 >= end:
        return
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    w_rows = (rank_offset + offs_r).to(tl.int64)
    acc = rank_product(x_ptr, w_ptr, offs_t, mask_t, w_rows, mask_r, K, stride_xt, stride_xk,
                       stride_wk, stride_wr, INTERPRETER, BLOCK_T, BLOCK_K, BLOCK_R)  # fmt: skip
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    # Columns in [rank, R_OUT) are written as zeros: h is fully defined for every token.
    store_tile(out_ptr, acc, offs_t, offs_r, stride_ot, stride_or, mask_t, offs_r < R_OUT)


_SHRINK_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
]
_SHRINK = _launch.autotuned(_shrink_kernel, _SHRINK_CONFIGS, key=["K", "R_OUT", "SCALED"])
# The interpreter pays ~50 ms per program whatever its tile size, so it gets large tiles.
_SHRINK_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_K": 64})


def lora_shrink(
    x: torch.Tensor, weight: torch.Tensor, layout: MultiLoraLayout, *, scaled: bool = False
) -> torch.Tensor:
    """`h[t, :r_i] = x[t] @ weight[rows of i]^T` (times `s_i` when `scaled`), zero-padded.

    x: `[T, K]`; weight: `[sum r, K]` (any strides: the backward passes `b_cat.t()`).
    Returns `[T, max_rank]` in x's dtype; columns at or beyond an adapter's rank are zero.
    """
    _launch.check_operands("lora_shrink", layout, x, weight)
    if x.shape[0] != layout.num_tokens:
        raise ValueError(f"lora_shrink: x has {x.shape[0]} tokens, layout {layout.num_tokens}")
    if weight.shape != (layout.total_rank, x.shape[1]):
        raise ValueError(
            f"lora_shrink: weight shape {tuple(weight.shape)} != (sum of ranks "
            f"{layout.total_rank}, K {x.shape[1]})"
        )
    out = torch.empty(x.shape[0], layout.max_rank, device=x.device, dtype=x.dtype)
    block_r = _launch.block_r(layout.max_rank)

    def grid(meta):
        return (
            triton.cdiv(layout.max_segment, meta["BLOCK_T"]),
            triton.cdiv(layout.max_rank, block_r),
            layout.num_adapters,
        )

    _launch.launch(
        _SHRINK,
        x.device,
        grid,
        (_SHRINK_INTERPRETED, _SHRINK_CONFIGS[0]),
        (x, weight, out, layout.meta, layout.scale_tensor, layout.num_adapters, x.shape[1],
         layout.max_rank, *x.stride(), *weight.stride(), *out.stride()),
        SCALED=scaled,
        BLOCK_R=block_r,
    )  # fmt: skip
    return out


def lora_shrink_reference(
    x: torch.Tensor, weight: torch.Tensor, layout: MultiLoraLayout, *, scaled: bool = False
) -> torch.Tensor:
    out = torch.zeros(x.shape[0], layout.max_rank, device=x.device, dtype=torch.float32)
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        h = x[s:e].float() @ weight[o : o + r].float().t()
        out[s:e, :r] = h * layout.scales[i] if scaled else h
    return out.to(x.dtype)
