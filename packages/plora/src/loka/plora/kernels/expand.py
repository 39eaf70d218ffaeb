"""Expand: `y[t] = base[t] + s? * h[t, :r_i] @ W_i^T`, W_i the columns of `weight` of adapter i.

Tiled over tokens and N, looping over the adapter's rank. The forward's `base + s_i h B_i^T`;
in the backward, `dx = dh A_i` (`weight` = `a_cat.t()`, no base).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import load_tile, mma, store_tile, token_block
from loka.plora.kernels.layout import MultiLoraLayout


@triton.jit
def _expand_kernel(
    h_ptr, w_ptr, base_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, N, R_MAX, stride_ht,
    stride_hr, stride_wn, stride_wr, stride_bt, stride_bn, stride_ot, stride_on,
    SCALED: tl.constexpr, HAS_BASE: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    adapter = tl.program_id(2)
    t0, end, offs_t, mask_t, rank, rank_offset = token_block(
        meta_ptr, num_adapters, adapter, pid_t, BLOCK_T
    )
    if t0 >= end:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        h = load_tile(h_ptr, offs_t, offs_r, stride_ht, stride_hr, mask_t, mask_r)
        w_cols = rank_offset + offs_r
        w = load_tile(w_ptr, w_cols, offs_n, stride_wr, stride_wn, mask_r, mask_n)
        acc = mma(h, w, acc, INTERPRETER)
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    if HAS_BASE:
        base = load_tile(base_ptr, offs_t, offs_n, stride_bt, stride_bn, mask_t, mask_n)
        acc = acc + base.to(tl.float32)
    store_tile(out_ptr, acc, offs_t, offs_n, stride_ot, stride_on, mask_t, mask_n)


_EXPAND_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
]
_EXPAND = _launch.autotuned(
    _expand_kernel, _EXPAND_CONFIGS, key=["N", "R_MAX", "SCALED", "HAS_BASE"]
)
_EXPAND_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_N": 64})


def lora_expand(
    h: torch.Tensor,
    weight: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    base: torch.Tensor | None = None,
    scaled: bool = True,
) -> torch.Tensor:
    """`y[t] = base[t] + h[t, :r_i] @ weight[:, cols of i]^T` (times `s_i` when `scaled`).

    h: `[T, >= max_rank]`; weight: `[N, sum r]` (any strides: the backward passes
    `a_cat.t()`); base: `[T, N]` or None (then y is the adapter term alone).
    """
    _launch.check_operands("lora_expand", layout, h, weight, *([] if base is None else [base]))
    num_tokens, n = h.shape[0], weight.shape[0]
    if num_tokens != layout.num_tokens or h.shape[1] < layout.max_rank:
        raise ValueError(
            f"lora_expand: h shape {tuple(h.shape)} does not fit layout "
            f"(T {layout.num_tokens}, max rank {layout.max_rank})"
        )
    if weight.shape[1] != layout.total_rank:
        raise ValueError(
            f"lora_expand: weight has {weight.shape[1]} rank columns, layout {layout.total_rank}"
        )
    if base is not None and base.shape != (num_tokens, n):
        raise ValueError(f"lora_expand: base shape {tuple(base.shape)} != ({num_tokens}, {n})")
    out = torch.empty(num_tokens, n, device=h.device, dtype=h.dtype)
    block_r = _launch.block_r(layout.max_rank)

    def grid(meta):
        return (
            triton.cdiv(layout.max_segment, meta["BLOCK_T"]),
            triton.cdiv(n, meta["BLOCK_N"]),
            layout.num_adapters,
        )

    base_arg = out if base is None else base  # never read when HAS_BASE is False
    _launch.launch(
        _EXPAND,
        h.device,
        grid,
        (_EXPAND_INTERPRETED, _EXPAND_CONFIGS[0]),
        (h, weight, base_arg, out, layout.meta, layout.scale_tensor, layout.num_adapters, n,
         layout.max_rank, *h.stride(), *weight.stride(), *base_arg.stride(), *out.stride()),
        SCALED=scaled,
        HAS_BASE=base is not None,
        BLOCK_R=block_r,
    )  # fmt: skip
    return out


def lora_expand_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    base: torch.Tensor | None = None,
    scaled: bool = True,
) -> torch.Tensor:
    out = torch.zeros(h.shape[0], weight.shape[0], device=h.device, dtype=torch.float32)
    if base is not None:
        out += base.float()
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        delta = h[s:e, :r].float() @ weight[:, o : o + r].float().t()
        out[s:e] += delta * layout.scales[i] if scaled else delta
    return out.to(h.dtype)
