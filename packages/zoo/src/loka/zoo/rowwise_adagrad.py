"""The row-wise Adagrad update of embedding rows: a Triton kernel, its launcher, and the
pure-torch reference beside them.

Given the distinct rows `[U]` a batch looked up and their summed gradients `[U, D]`:
`state[r] += mean(g_r ** 2)`, `w_r -= lr * g_r / (sqrt(state[r]) + eps)`. The kernel does it
in one pass, a program per row (read the gradient, read and write the accumulator and the
row); the reference takes a handful of torch kernels. `rowwise_adagrad_` picks the kernel for
CUDA tensors when Triton is installed, the reference otherwise.

The sparse gradient of a table holds one row per lookup, duplicates included (an uncoalesced
COO tensor). `rowwise_adagrad_sparse_` takes it as it is, without `coalesce()`: on CUDA the
lookups are sorted once by row (`torch.sort`, a radix sort) and two Triton kernels do the rest
with no host sync: `segment_partials` sums each run of equal rows within fixed chunks of the
sorted lookups (CHUNK of them, in order), and `segment_rowwise_adagrad` gives each distinct
row one program that adds its chunk partials (a hot row looked up 20k times reads ~650 of
them, HEADS at a time) and applies the update. Every chunk's work is bounded, so a hot row
costs no long serial loop (coalesce's value kernel sums a row's duplicates in one warp, one
after the other), and the order of the sums is fixed: the result is deterministic. Elsewhere
the pure-torch `dedupe_rows` (`torch.unique` with inverse, `index_add_`) feeds the reference.

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


def _check_table(weight: torch.Tensor, state: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be a 2-D table with contiguous rows, got {tuple(weight.shape)}"
        )
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape != weight.shape[:1]:
        raise ValueError("state must be a contiguous float32 vector, one value per table row")


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
    _check_table(weight, state)
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


# Tuning, read at each launch (bench/sparse_update.py --variants tries others): sorted
# lookups per chunk of the partial-sum kernel, chunk partials a row's program adds at a time,
# sorted lookups per program of the update kernel. UPDATE_ROWS 16 (was 1): on the H200 at
# Wukong xl's tables (532k lookups, 47k rows) the step took 0.349 ms instead of 0.534 ms
# (coalesce first: 7.50 ms), bench/results/sparse_update_xl_20261202T061021Z.json.
CHUNK = 32
HEADS = 32
UPDATE_ROWS = 16


def dedupe_rows(rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(distinct rows [U], their summed gradients [U, D] in float32)` of the lookups
    `rows [N]` with gradients `values [N, D]`, duplicates summed: what `coalesce()` gives,
    by `torch.unique` and `index_add_` (pure torch; the rows come out sorted)."""
    distinct, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    summed = torch.zeros(
        distinct.numel(), values.size(1), dtype=torch.float32, device=values.device
    )
    return distinct, summed.index_add_(0, inverse, values.float())


def rowwise_adagrad_sparse_reference_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    *,
    lr: float,
    eps: float,
    bag: int = 1,
    skip_row: int = -1,
) -> None:
    """Row-wise Adagrad from lookups `rows [N]` (duplicates allowed) and their gradients
    `values [N // bag, D]` (lookup j's is row `j // bag`: one per bag of `bag` lookups),
    leaving out lookups of `skip_row` (a padding row; -1: none): duplicates summed first
    (`dedupe_rows`), then the reference update."""
    if bag > 1:
        values = values.repeat_interleave(bag, 0)
    if skip_row >= 0:
        keep = rows != skip_row  # a host sync on CUDA: the reference's, not the kernels'
        rows, values = rows[keep], values[keep]
    if rows.numel() == 0:
        return
    distinct, summed = dedupe_rows(rows, values)
    rowwise_adagrad_reference_(weight, state, distinct, summed, lr=lr, eps=eps)


@functools.cache
def _segment_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def segment_partials_kernel(
        sorted_ptr, order_ptr, values_ptr, partial_ptr, n, dim, value_stride, bag, skip_row,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Sum each run of equal rows inside this chunk of the sorted lookups, in order; a
        # run's sum goes to the partial slot of its first lookup in the chunk. Unrolled: the
        # CHUNK gathers of gradient rows do not wait on one another.
        first = tl.program_id(0).to(tl.int64) * CHUNK
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        head = first
        for k in tl.static_range(CHUNK):
            j = first + k
            valid = j < n
            row = tl.load(sorted_ptr + j, mask=valid, other=-2)
            # Lookup src's gradient is row src // bag of the values (one per bag).
            src = tl.load(order_ptr + j, mask=valid, other=0) // bag
            wanted = inside & valid & (row != skip_row)
            v = tl.load(values_ptr + src * value_stride + cols, mask=wanted, other=0.0)
            acc += v.to(tl.float32)
            following = tl.load(sorted_ptr + j + 1, mask=(j + 1 < n) & (k + 1 < CHUNK), other=-1)
            ends = valid & (following != row)
            tl.store(partial_ptr + head * dim + cols, acc, mask=inside & ends)
            acc = tl.where(ends, 0.0, acc)
            head = tl.where(ends, j + 1, head)

    @triton.jit
    def segment_rowwise_adagrad_kernel(
        weight_ptr, state_ptr, sorted_ptr, ends_ptr, partial_ptr, n, dim, weight_stride, lr,
        eps, skip_row, CHUNK: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # A program per ROWS sorted lookups; the first lookup of each row does its update.
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        for r in range(ROWS):
            i = tl.program_id(0).to(tl.int64) * ROWS + r
            row = tl.load(sorted_ptr + i, mask=i < n, other=-1).to(tl.int64)
            before = tl.load(sorted_ptr + i - 1, mask=(i > 0) & (i < n), other=-1).to(tl.int64)
            if (row != before) & (row != skip_row):
                # The row's first chunk partial, then the one at the start of each later
                # chunk its lookups reach.
                g = tl.load(partial_ptr + i * dim + cols, mask=inside, other=0.0)
                last_chunk = (tl.load(ends_ptr + i) - 1) // CHUNK
                # (A while loop: its trip count is data, which Triton's interpreter cannot
                # take as a range bound.)
                c = i // CHUNK + 1
                while c <= last_chunk:
                    chunks = c + tl.arange(0, HEADS).to(tl.int64)
                    tile = tl.load(
                        partial_ptr + (chunks * CHUNK * dim)[:, None] + cols[None, :],
                        mask=(chunks <= last_chunk)[:, None] & inside[None, :], other=0.0,
                    )  # fmt: skip
                    g += tl.sum(tile, axis=0)
                    c += HEADS
                accumulated = tl.load(state_ptr + row) + tl.sum(g * g, axis=0) / dim
                tl.store(state_ptr + row, accumulated)
                row_ptrs = weight_ptr + row * weight_stride + cols
                w = tl.load(row_ptrs, mask=inside).to(tl.float32)
                w = w - g * (lr / (tl.sqrt(accumulated) + eps))
                tl.store(row_ptrs, w.to(weight_ptr.dtype.element_ty), mask=inside)

    return segment_partials_kernel, segment_rowwise_adagrad_kernel


def rowwise_adagrad_sparse_triton_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    *,
    lr: float,
    eps: float,
    bag: int = 1,
    skip_row: int = -1,
) -> None:
    """The sparse reference's update without `coalesce()` and without a host sync: sort the
    lookups once, sum runs of equal rows in chunks, one program per distinct row adds its
    chunk partials and updates the row (CUDA, or the CPU under TRITON_INTERPRET=1). Lookups
    of `skip_row` are sorted with the others but neither read nor updated."""
    _check_table(weight, state)
    n = rows.numel()
    if n == 0:
        return
    if bag < 1 or n % bag or values.shape != (n // bag, weight.size(1)):
        raise ValueError(
            f"values must be [{n} // {bag}, {weight.size(1)}] (one gradient row per bag of "
            f"{bag} lookups), got {tuple(values.shape)}"
        )
    # int32 keys sort in half the radix passes of int64 ones.
    keys = rows.to(torch.int32) if weight.size(0) < 2**31 else rows
    sorted_rows, order = torch.sort(keys, stable=True)
    ends = torch.searchsorted(sorted_rows, sorted_rows, right=True)
    values = values.contiguous()
    dim = weight.size(1)
    partials = torch.empty(n, dim, dtype=torch.float32, device=values.device)
    block = 1 << (dim - 1).bit_length()
    partials_kernel, update_kernel = _segment_kernels()
    # A gathered row per step: one warp reads 128 values 16 bytes a thread.
    partials_kernel[(-(-n // CHUNK),)](
        sorted_rows, order, values, partials, n, dim, values.stride(0), bag, skip_row,
        CHUNK=CHUNK, BLOCK=block, num_warps=max(1, min(8, block // 128)),
    )  # fmt: skip
    update_kernel[(-(-n // UPDATE_ROWS),)](
        weight, state, sorted_rows, ends, partials, n, dim, weight.stride(0), float(lr),
        float(eps), skip_row, CHUNK=CHUNK, HEADS=HEADS, ROWS=UPDATE_ROWS, BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )  # fmt: skip


def rowwise_adagrad_sparse_(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    *,
    lr: float,
    eps: float,
    bag: int = 1,
    skip_row: int = -1,
) -> None:
    """Row-wise Adagrad from uncoalesced lookups (`rows [N]` with duplicates, `values
    [N // bag, D]`, lookups of `skip_row` left out): the Triton kernels on CUDA when Triton
    is installed, else the reference."""
    update = (
        rowwise_adagrad_sparse_triton_
        if weight.is_cuda and triton_available()
        else rowwise_adagrad_sparse_reference_
    )
    update(weight, state, rows, values, lr=lr, eps=eps, bag=bag, skip_row=skip_row)


# The fused path: the update runs in the lookup's backward (as TorchRec's fused optimizer).


@torch.library.custom_op("loka_zoo::rowwise_adagrad_bag_update_", mutates_args=("weight", "state"))
def _bag_update(
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    grad_out: torch.Tensor,
    lr: float,
    eps: float,
    skip_row: int,
) -> None:
    """Row-wise Adagrad of the bags `rows [bags, L]` from their output gradient `[bags, D]`:
    one opaque op for torch.compile, mutating the table and its accumulator."""
    rowwise_adagrad_sparse_(
        weight, state, rows.reshape(-1), grad_out, lr=lr, eps=eps, bag=rows.size(1),
        skip_row=skip_row,
    )  # fmt: skip


@_bag_update.register_fake
def _(weight, state, rows, grad_out, lr, eps, skip_row) -> None:
    return None


class FusedBagUpdate(torch.autograd.Function):
    """Sum-pooled bags of `weight` looked up at `rows [bags, L]` whose backward applies
    row-wise Adagrad to the rows looked up (duplicates summed, `padding_idx` left out) in
    place and returns no table gradient: no `[lookups, D]` gradient, no sparse tensor, no
    host sync. `trigger` (a 0-dim tensor that requires grad) makes autograd run the
    backward; `weight` must not require grad (it is mutated there)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        trigger: torch.Tensor,
        weight: torch.Tensor,
        rows: torch.Tensor,
        state: torch.Tensor,
        lr: float,
        eps: float,
        padding_idx: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.table = (weight, state, lr, eps, padding_idx)
        return torch.nn.functional.embedding_bag(rows, weight, mode="sum", padding_idx=padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        weight, state, lr, eps, padding_idx = ctx.table
        _bag_update(weight, state, rows, grad_out.contiguous(), lr, eps, padding_idx)
        return (None,) * 7
