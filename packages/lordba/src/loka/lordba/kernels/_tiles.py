"""Device helpers shared by the sign-GEMM kernels."""

import triton
import triton.language as tl


@triton.jit
def unpack_sign_tile(
    packed_ptr,
    row_offsets,
    byte_offset,
    row_stride,
    n_rows,
    length,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Load a ``[BLOCK_ROWS, BLOCK_COLS]`` tile of +-1 (0 outside the matrix) as float32.

    Starts at sign column ``8 * byte_offset``. Each byte is loaded once and fanned out to its
    eight signs in registers; callers cast to their dot dtype.
    """
    BLOCK_BYTES: tl.constexpr = BLOCK_COLS // 8
    bytes_idx = byte_offset + tl.arange(0, BLOCK_BYTES)
    row_ok = row_offsets < n_rows
    byte_ok = bytes_idx < (length + 7) // 8
    raw = tl.load(
        packed_ptr + row_offsets[:, None] * row_stride + bytes_idx[None, :],
        mask=row_ok[:, None] & byte_ok[None, :],
        other=0,
    ).to(tl.int32)
    bit_idx = tl.arange(0, 8)
    bits = (raw[:, :, None] >> bit_idx[None, None, :]) & 1
    bits = tl.reshape(bits, (BLOCK_ROWS, BLOCK_COLS))
    cols = byte_offset * 8 + tl.arange(0, BLOCK_COLS)
    valid = row_ok[:, None] & (cols < length)[None, :]
    return tl.where(valid, 1.0 - 2.0 * bits.to(tl.float32), 0.0)


@triton.jit
def mma(a, b, acc, INTERPRETER: tl.constexpr):
    """``acc + a @ b``. Triton 3.6's interpreter keeps bf16 as raw uint16 and its ``tl.dot``
    multiplies those integers, so there the (exact) widening to float32 comes first."""
    if INTERPRETER:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


@triton.jit
def sign_down_rows(
    x_ptr,
    packed_ptr,
    scale_ptr,
    rows,
    row_ok,
    ranks,
    C,
    R,
    stride_xm,
    stride_pr,
    HAS_SCALE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``(x[rows] * scale) @ S^T`` as a float32 ``[BLOCK_M, BLOCK_R]`` block, reduced over C
    in ``BLOCK_C`` steps; ``scale`` is folded into the sign tile (R x BLOCK_C multiplies
    instead of BLOCK_M x BLOCK_C), so the only large traffic is one read of ``x``."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        signs = unpack_sign_tile(packed_ptr, ranks, c0 // 8, stride_pr, R, C, BLOCK_R, BLOCK_C)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            signs = signs * scale[None, :]
        acc = mma(x, tl.trans(signs.to(x.dtype)), acc, INTERPRETER)
    return acc
