"""Launch-side helpers shared by the sign-GEMM launchers: operand checks, tiles, launching."""

from __future__ import annotations

import torch
import triton

from loka.kernels.runtime import autotuning, next_pow2, require_triton_device
from loka.lordba.kernels.packing import check_packed_signs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected one of float32/float16/bfloat16, got {tensor.dtype}")


def check_matrix(tensor: torch.Tensor, name: str, shape: tuple[int, int]) -> None:
    """Check a 2-D float operand's shape (``-1`` matches any size)."""
    check_float(tensor, name)
    if tensor.dim() != 2 or any(
        want not in (-1, got) for want, got in zip(shape, tensor.shape, strict=True)
    ):
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")


def check_vector(tensor: torch.Tensor | None, name: str, length: int) -> None:
    if tensor is None:
        return
    check_float(tensor, name)
    if tuple(tensor.shape) != (length,):
        raise ValueError(f"{name}: expected shape ({length},), got {tuple(tensor.shape)}")


def check_signs(packed: torch.Tensor, rank: int, length: int, name: str) -> None:
    check_packed_signs(packed, rank, length, name)


def packed_rank(packed: torch.Tensor) -> int:
    """Rows of a packed sign tensor (-1 when it is not 2-D, which the checks then report)."""
    return packed.shape[0] if packed.dim() == 2 else -1


def rank_block(rank: int) -> int:
    """Padded rank tile: a power of two, at least 16 (the smallest ``tl.dot`` dimension)."""
    return max(16, next_pow2(rank))


def unit_stride_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels walk rows with a stride and columns with stride 1."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def m_bucket(rows: int) -> int:
    """Autotuning key for the token count: its power-of-two bucket, so a new M seldom retunes."""
    return min(next_pow2(max(rows, 1)), 1 << 16)


def tuning_configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """``(BLOCK_M, BLOCK_C, num_warps, num_stages)`` tuples as autotuner configs. Kept to a
    handful: every config is compiled for every specialization (dtype, fused options)."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_C": bc}, num_warps=warps, num_stages=stages)
        for bm, bc, warps, stages in tiles
    ]


def launch(kernel, tuned, grid, args, *, device, interpreted, heuristic, **constexprs) -> None:
    """Run ``kernel`` on the GPU through its autotuner (one ``heuristic`` config when
    LOKA_KERNELS_AUTOTUNE=0), or under the CPU interpreter with the small ``interpreted``
    tile, which keeps tests exercising the loops and masks."""
    require_triton_device(*(a for a in args if isinstance(a, torch.Tensor)))
    if device.type == "cuda" and autotuning():
        tuned[grid](*args, **constexprs, INTERPRETER=False)
        return
    config = heuristic if device.type == "cuda" else interpreted
    kernel[grid](
        *args,
        **constexprs,
        **config.kwargs,
        INTERPRETER=device.type != "cuda",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
