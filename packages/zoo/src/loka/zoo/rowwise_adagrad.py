"""The row-wise Adagrad update of embedding rows: a Triton kernel, its launcher, and the
pure-torch reference beside them.

Given the distinct rows `[U]` a batch looked up and their summed gradients `[U, D]`:
`state[r] += mean(g_r ** 2)`, `w_r -= lr * g_r / (sqrt(state[r]) + eps)`. The kernel does it
in one pass, a program per row (read the gradient, read and write the accumulator and the
row); the reference takes a handful of torch kernels. `rowwise_adagrad_` picks the kernel for
CUDA tensors when Triton is installed, the reference otherwise.

Triton decides between compiling and interpreting when a kernel is defined, so the kernel
is defined at its first launch: with TRITON_INTERPRET=1 set before that, it runs on the CPU
in Triton's interpreter (the tests do this).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch


def rowwise_adagrad_reference_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """Update `weight [R, D]` and `state [R]` (float32) in place at the distinct `rows [U]`
    with their summed gradients `grads [U, D]`."""
    g = grads.float()
    accumulated = state.index_select(0, rows) + g.square().mean(1)
    state.index_copy_(0, rows, accumulated)
    # Distinct rows: read, update in float32, write back (one rounding for low-precision tables).
    updated = weight.index_select(0, rows).float() - g * (
        lr / (accumulated.sqrt() + eps)
    ).unsqueeze(1)
    weight.index_copy_(0, rows, updated.to(weight.dtype))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rowwise_adagrad_kernel(
        weight_ptr, state_ptr, rows_ptr, grads_ptr, dim, weight_stride, grad_stride, lr, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + i)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        g = tl.load(grads_ptr + i * grad_stride + cols, mask=inside, other=0.0).to(tl.float32)
        accumulated = tl.load(state_ptr + row) + tl.sum(g * g, axis=0) / dim
        tl.store(state_ptr + row, accumulated)
        row_ptrs = weight_ptr + row * weight_stride + cols
        w = tl.load(row_ptrs, mask=inside).to(tl.float32)
        w = w - g * (lr / (tl.sqrt(accumulated) + eps))
        tl.store(row_ptrs, w.to(weight_ptr.dtype.element_ty), mask=inside)

    return rowwise_adagrad_kernel


def rowwise_adagrad_triton_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """The reference's update in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be a 2-D table with contiguous rows, got {tuple(weight.shape)}"
        )
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape != weight.shape[:1]:
        raise ValueError("state must be a contiguous float32 vector, one value per table row")
    if rows.numel() == 0:
        return
    grads = grads.contiguous()
    dim = weight.size(1)
    block = 1 << (dim - 1).bit_length()
    _kernel()[(rows.numel(),)](
        weight, state, rows.contiguous(), grads, dim, weight.stride(0), grads.stride(0),
        float(lr), float(eps), BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )  # fmt: skip


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def rowwise_adagrad_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    *,
    lr: float,
    eps: float,
) -> None:
    """The update, by the Triton kernel on CUDA when Triton is installed, else by the reference."""
    if weight.is_cuda and triton_available():
        rowwise_adagrad_triton_(weight, state, rows, grads, lr=lr, eps=eps)
    else:
        rowwise_adagrad_reference_(weight, state, rows, grads, lr=lr, eps=eps)
