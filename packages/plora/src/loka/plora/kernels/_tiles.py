"""Device helpers shared by the segmented kernels: tile loads and stores, the MMA, and where
each adapter's tokens and rank rows are."""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, INTERPRETER: tl.constexpr):
    # Triton 3.6's interpreter keeps bf16 as raw uint16, so its tl.dot on bf16 returns
    # integer garbage; it multiplies correctly in fp32. Compiled kernels use the tensor cores.
    if INTERPRETER:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


@triton.jit
def load_tile(ptr, rows, cols, stride_row, stride_col, row_mask, col_mask):
    return tl.load(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )


@triton.jit
def store_tile(ptr, value, rows, cols, stride_row, stride_col, row_mask, col_mask):
    tl.store(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
        value.to(ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def load_adapter(meta_ptr, num_adapters, adapter):
    """(start, end, rank, rank offset) of `adapter` from the layout's int32 [4, N] table."""
    start = tl.load(meta_ptr + adapter)
    end = tl.load(meta_ptr + num_adapters + adapter)
    rank = tl.load(meta_ptr + 2 * num_adapters + adapter)
    rank_offset = tl.load(meta_ptr + 3 * num_adapters + adapter)
    return start, end, rank, rank_offset


@triton.jit
def token_block(meta_ptr, num_adapters, adapter, pid_t, BLOCK_T: tl.constexpr):
    """Rows of the pid_t-th token block of `adapter`'s segment (t0 >= end: nothing to do)."""
    start, end, rank, rank_offset = load_adapter(meta_ptr, num_adapters, adapter)
    t0 = start + pid_t * BLOCK_T
    offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    return t0, end, offs_t, offs_t < end, rank, rank_offset


@triton.jit
def rank_product(
    in_ptr, w_ptr, offs_t, mask_t, rows, mask_r, F, stride_it, stride_if, stride_wf, stride_wr,
    INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """`in[offs_t, :F] @ w[:F, rows]` in fp32 (`[BLOCK_T, BLOCK_R]`): the fused kernels'
    product down to the adapter's rank (`x A_i^T` forward, `dy B_i` backward)."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask_f = offs_f < F
        inp = load_tile(in_ptr, offs_t, offs_f, stride_it, stride_if, mask_t, mask_f)
        w = load_tile(w_ptr, offs_f, rows, stride_wf, stride_wr, mask_f, mask_r)
        acc = mma(inp, w, acc, INTERPRETER)
    return acc
