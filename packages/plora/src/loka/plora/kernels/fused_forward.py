"""Fused forward: `h = x A_i^T` and `y = base + s_i h B_i^T` in one launch, h kept in registers.

One program per (token block of adapter i, group of N tiles): it loops over K once to build
`h` (`[BLOCK_T, BLOCK_R]`, the adapter's whole rank), stores it (the backward needs it) and
then loops over its N tiles adding `s_i h B_i^T` to the base output. x is read once, h never
goes through memory between the two products, one launch instead of shrink + expand. With
few token blocks (a small batch) the N tiles are split into groups, each group recomputing h
(x re-read once per group) so the grid still fills the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import load_tile, mma, rank_product, store_tile, token_block
from loka.plora.kernels.layout import MultiLoraLayout


@triton.jit
def _forward_kernel(
    x_ptr, a_ptr, b_ptr, base_ptr, y_ptr, h_ptr, meta_ptr, scale_ptr, num_adapters, K, N, R_OUT,
    n_per_group, stride_xt, stride_xk, stride_ar, stride_ak, stride_bn, stride_br, stride_bt,
    stride_bbn, stride_yt, stride_yn, stride_ht, stride_hr,
    INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    group = tl.program_id(1)
    adapter = tl.program_id(2)
    t0, end, offs_t, mask_t, rank, rank_offset = token_block(
        meta_ptr, num_adapters, adapter, pid_t, BLOCK_T
    )
    if t0 >= end:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    rows = (rank_offset + offs_r).to(tl.int64)
    acc = rank_product(x_ptr, a_ptr, offs_t, mask_t, rows, mask_r, K, stride_xt, stride_xk,
                       stride_ak, stride_ar, INTERPRETER, BLOCK_T, BLOCK_K, BLOCK_R)  # fmt: skip
    h = acc.to(y_ptr.dtype.element_ty)  # rounded as the unfused path stores it
    if group == 0:  # columns in [rank, R_OUT) are zeros: h is defined for every token
        store_tile(h_ptr, h, offs_t, offs_r, stride_ht, stride_hr, mask_t, offs_r < R_OUT)
    scale = tl.load(scale_ptr + adapter)
    n_start = group * n_per_group
    n_end = tl.minimum(n_start + n_per_group, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_end
        b = load_tile(b_ptr, rows, offs_n, stride_br, stride_bn, mask_r, mask_n)
        y = mma(h, b, tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32), INTERPRETER) * scale
        base = load_tile(base_ptr, offs_t, offs_n, stride_bt, stride_bbn, mask_t, mask_n)
        store_tile(y_ptr, y + base.to(tl.float32), offs_t, offs_n, stride_yt, stride_yn, mask_t,
                   mask_n)  # fmt: skip


_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    # Finer token blocks: more programs per wave when the batch has few hundred blocks.
    triton.Config({"BLOCK_T": 32, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
]
# y may be base itself (written in place): tuning restores it after each run.
_FORWARD = _launch.autotuned(
    _forward_kernel, _FORWARD_CONFIGS, key=["K", "N", "R_OUT"], restore_value=["y_ptr"]
)
_FORWARD_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_K": 64, "BLOCK_N": 64})


def lora_forward(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    base: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    groups: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, h)`: `h[t, :r_i] = x[t] A_i^T` (zero-padded to max rank, x's dtype) and
    `y[t] = base[t] + s_i h[t, :r_i] B_i^T`, in one launch.

    x: `[T, K]`; a_cat: `[sum r, K]`; b_cat: `[N, sum r]`; base: `[T, N]`; max rank at
    most `MAX_FUSED_RANK`. `groups`: how many parts the N tiles are split into (None: as
    many as fill the GPU, `_launch.split_groups`). `out`: where y goes (`[T, N]`, x's dtype;
    it may be `base` itself: each tile of base is read before the same program writes it).
    """
    _launch.check_operands("lora_forward", layout, x, a_cat, b_cat, base)
    _launch.check_fused_rank("lora_forward", layout)
    t, k = x.shape
    n = b_cat.shape[0]
    if t != layout.num_tokens or a_cat.shape != (layout.total_rank, k):
        raise ValueError(
            f"lora_forward: x {tuple(x.shape)} / a_cat {tuple(a_cat.shape)} do not fit the "
            f"layout (T {layout.num_tokens}, sum of ranks {layout.total_rank})"
        )
    if b_cat.shape[1] != layout.total_rank or base.shape != (t, n):
        raise ValueError(
            f"lora_forward: b_cat {tuple(b_cat.shape)} / base {tuple(base.shape)} do not fit "
            f"(N, sum of ranks {layout.total_rank}) / (T {t}, N)"
        )
    if out is not None and (out.shape != (t, n) or out.dtype != x.dtype):
        raise ValueError(f"lora_forward: out must be ({t}, {n}) {x.dtype}")
    y = torch.empty(t, n, device=x.device, dtype=x.dtype) if out is None else out
    h = torch.empty(t, layout.max_rank, device=x.device, dtype=x.dtype)
    count, per_group = _launch.split_groups(layout, n, groups)
    block_r = _launch.block_r(layout.max_rank)

    def grid(meta):
        return (_launch.cdiv(layout.max_segment, meta["BLOCK_T"]), count, layout.num_adapters)

    _launch.launch(
        _FORWARD,
        x.device,
        grid,
        (_FORWARD_INTERPRETED, _FORWARD_CONFIGS[0]),
        (x, a_cat, b_cat, base, y, h, layout.meta, layout.scale_tensor, layout.num_adapters,
         k, n, layout.max_rank, per_group, *x.stride(), *a_cat.stride(), *b_cat.stride(),
         *base.stride(), *y.stride(), *h.stride()),
        BLOCK_R=block_r,
    )  # fmt: skip
    return y, h


def lora_forward_reference(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    base: torch.Tensor,
    layout: MultiLoraLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, h)` as a loop over adapters in float32, h rounded to x's dtype before the up
    product (as the kernel does)."""
    y = base.float().clone()
    h = torch.zeros(x.shape[0], layout.max_rank, dtype=x.dtype, device=x.device)
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        hi = (x[s:e].float() @ a_cat[o : o + r].float().t()).to(x.dtype)
        h[s:e, :r] = hi
        y[s:e] += (hi.float() @ b_cat[:, o : o + r].float().t()) * layout.scales[i]
    return y.to(x.dtype), h
