"""Fused backward (data side): `dh = s_i dy B_i` and `dx = dh A_i` in one launch, dh kept in
registers.

One program per (token block of adapter i, group of K tiles): it loops over N once to build
`dh` (`[BLOCK_T, BLOCK_R]`), stores it (the weight gradient `dA = dh^T x` needs it) and then
loops over its K tiles writing `dh A_i`. dy is read once, one launch instead of a shrink and
an expand. Few token blocks: the K tiles are split into groups, each recomputing dh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import load_tile, mma, rank_product, store_tile, token_block
from loka.plora.kernels.layout import MultiLoraLayout


@triton.jit
def _backward_data_kernel(
    dy_ptr, a_ptr, b_ptr, dx_ptr, dh_ptr, meta_ptr, scale_ptr, num_adapters, K, N, R_OUT,
    k_per_group, stride_dyt, stride_dyn, stride_ar, stride_ak, stride_bn, stride_br,
    stride_dxt, stride_dxk, stride_dht, stride_dhr,
    HAS_DX: tl.constexpr, ACCUMULATE: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
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
    acc = rank_product(dy_ptr, b_ptr, offs_t, mask_t, rows, mask_r, N, stride_dyt, stride_dyn,
                       stride_bn, stride_br, INTERPRETER, BLOCK_T, BLOCK_N, BLOCK_R)  # fmt: skip
    dh = (acc * tl.load(scale_ptr + adapter)).to(dh_ptr.dtype.element_ty)
    if group == 0:
        store_tile(dh_ptr, dh, offs_t, offs_r, stride_dht, stride_dhr, mask_t, offs_r < R_OUT)
    if HAS_DX:
        k_start = group * k_per_group
        k_end = tl.minimum(k_start + k_per_group, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            a = load_tile(a_ptr, rows, offs_k, stride_ar, stride_ak, mask_r, mask_k)
            dx = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
            if ACCUMULATE:  # dx += dh A_i: the base GEMM's dgrad is already there
                dx = load_tile(dx_ptr, offs_t, offs_k, stride_dxt, stride_dxk, mask_t, mask_k)
                dx = dx.to(tl.float32)
            dx = mma(dh, a, dx, INTERPRETER)
            store_tile(dx_ptr, dx, offs_t, offs_k, stride_dxt, stride_dxk, mask_t, mask_k)


_BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_T": 32, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
]
# dx may be the base GEMM's input gradient, added to in place (ACCUMULATE): tuning runs each
# config several times, so it restores dx after each run, or the adapters' term is added as
# often as the kernel ran (the H200 bench measured dx off by 336x relative error).
_BACKWARD = _launch.autotuned(
    _backward_data_kernel, _BACKWARD_CONFIGS, key=["K", "N", "R_OUT", "HAS_DX"],
    restore_value=["dx_ptr"],
)  # fmt: skip
_BACKWARD_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_K": 64, "BLOCK_N": 64})


def lora_backward_data(
    dy: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    need_dx: bool = True,
    groups: int | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`(dx, dh)`: `dh[t, :r_i] = s_i dy[t] B_i` (zero-padded to max rank, dy's dtype) and
    `dx[t] = dh[t, :r_i] A_i` (None unless `need_dx`), in one launch.

    dy: `[T, N]`; a_cat: `[sum r, K]`; b_cat: `[N, sum r]`. `groups` as in `lora_forward`.
    `accumulate_into` (`[T, K]`, dy's dtype; with `need_dx`): `dh A_i` is added to it in place
    (fp32 sum, one rounding) and it is returned as dx: the base GEMM's input gradient takes
    the adapters' without a separate add.
    """
    _launch.check_operands("lora_backward_data", layout, dy, a_cat, b_cat)
    _launch.check_fused_rank("lora_backward_data", layout)
    t, n = dy.shape
    k = a_cat.shape[1]
    if t != layout.num_tokens or b_cat.shape != (n, layout.total_rank):
        raise ValueError(
            f"lora_backward_data: dy {tuple(dy.shape)} / b_cat {tuple(b_cat.shape)} do not "
            f"fit the layout (T {layout.num_tokens}, sum of ranks {layout.total_rank})"
        )
    if a_cat.shape[0] != layout.total_rank:
        raise ValueError(
            f"lora_backward_data: a_cat has {a_cat.shape[0]} rows, layout {layout.total_rank}"
        )
    dh = torch.empty(t, layout.max_rank, device=dy.device, dtype=dy.dtype)
    if accumulate_into is not None and (
        not need_dx or accumulate_into.shape != (t, k) or accumulate_into.dtype != dy.dtype
    ):
        raise ValueError(f"lora_backward_data: accumulate_into must be ({t}, {k}) {dy.dtype}")
    dx = accumulate_into
    if dx is None and need_dx:
        dx = torch.empty(t, k, device=dy.device, dtype=dy.dtype)
    count, per_group = _launch.split_groups(layout, k, groups) if need_dx else (1, k)
    block_r = _launch.block_r(layout.max_rank)
    dx_arg = dh if dx is None else dx  # never written when HAS_DX is False

    def grid(meta):
        return (_launch.cdiv(layout.max_segment, meta["BLOCK_T"]), count, layout.num_adapters)

    _launch.launch(
        _BACKWARD,
        dy.device,
        grid,
        (_BACKWARD_INTERPRETED, _BACKWARD_CONFIGS[0]),
        (dy, a_cat, b_cat, dx_arg, dh, layout.meta, layout.scale_tensor, layout.num_adapters,
         k, n, layout.max_rank, per_group, *dy.stride(), *a_cat.stride(), *b_cat.stride(),
         *dx_arg.stride(), *dh.stride()),
        HAS_DX=need_dx,
        ACCUMULATE=accumulate_into is not None,
        BLOCK_R=block_r,
    )  # fmt: skip
    return dx, dh


def lora_backward_data_reference(
    dy: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dx, dh)` as a loop over adapters in float32, dh rounded to dy's dtype before dx."""
    dx = torch.zeros(dy.shape[0], a_cat.shape[1], dtype=torch.float32, device=dy.device)
    dh = torch.zeros(dy.shape[0], layout.max_rank, dtype=dy.dtype, device=dy.device)
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        dhi = ((dy[s:e].float() @ b_cat[:, o : o + r].float()) * layout.scales[i]).to(dy.dtype)
        dh[s:e, :r] = dhi
        dx[s:e] = dhi.float() @ a_cat[o : o + r].float()
    return dx.to(dy.dtype), dh
