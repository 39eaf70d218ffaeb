"""FP8 quantization: tensorwise, rowwise, and 1x128 / 128x128 blockwise.

Kernels: `_amax_kernel` + `_quantize_tensor_kernel` (two phases: the amax, then one read
that quantizes; with a given amax, the delayed-scaling case, only the second), and
`_quantize_groups_kernel` for rows and blocks (one read: a row or block is held in registers
while its amax, scale and FP8 values are computed). `quantize` launches them;
`quantize_reference` wraps the pure-torch definition they must match byte for byte
(`loka.schema.fp8.quantize_reference`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loka.kernels.formats import check_high_precision_2d
from loka.kernels.fp8_bits import FORMAT_IDS
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.launch import Launcher
from loka.kernels.runtime import aligned, cdiv, interpreting, next_pow2, require_triton_device
from loka.kernels.scaling import (
    finite_abs_tl,
    inverse_tl,
    saturate_cast_tl,
    scale_from_amax_tl,
    ub_args,
)
from loka.schema import QuantConfig
from loka.schema.fp8 import quantize_reference as schema_reference
from loka.schema.fp8 import scale_from_amax

__all__ = [
    "quantize",
    "quantize_reference",
    "quantize_with",
]

# Rows up to this many elements are quantized from registers in one read.
MAX_ROW_IN_REGISTERS = 16384
# Rowwise tiles: at least `elements` per program (whole rows when they fit), `warps` per
# program (None: by tile size). Measured on an H200 (bench/kernels.py --sections tune).
ROW_TILE: dict[str, int | None] = {"elements": 4096, "warps": 4}


@triton.jit
def _amax_partials_kernel(
    x_ptr, amax_ptr, R, C, stride_r, stride_c, tiles_c, tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program p writes the amax of tiles p, p + programs, ... to amax[1 + p] (the layout of
    `_quantize_tensor_kernel`): no atomics, so no zeroing launch, and the quantizing kernel
    reduces the partials itself."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for t in range(pid, tiles, tl.num_programs(0)):
        rows = ((t // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = (t % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(
            x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0
        )
        acc = tl.maximum(acc, finite_abs_tl(x))
    tl.store(amax_ptr + 1 + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def tensor_amax_tl(
    x, amax_in_ptr, amax_ptr, partials, DELAYED: tl.constexpr, PARTIALS: tl.constexpr
):
    """The amax a tensorwise scale is set from. Dynamic: the max of the partial amaxes in
    amax[1:]. DELAYED: amax_in, while the amax seen in x gathers by atomic max in amax[0]."""
    if DELAYED:
        tl.atomic_max(amax_ptr, tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0))
        return tl.load(amax_in_ptr)
    else:
        p = tl.arange(0, PARTIALS)
        return tl.max(tl.load(amax_ptr + 1 + p, mask=p < partials, other=0.0), axis=0)


@triton.jit
def _quantize_tensor_kernel(
    x_ptr, q_ptr, amax_in_ptr, amax_ptr, scale_ptr, inv_ptr,
    R, C, stride_r, stride_c, partials, scale_ub,
    FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr,
    DELAYED: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """amax = [amax seen, partial amaxes...].

    Dynamic: the amax is the max of the partials `_amax_partials_kernel` wrote. DELAYED: the
    scale comes from amax_in, and the amax seen in x is gathered by atomic max into amax[0]
    (zeroed by the host).
    """
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    amax = tensor_amax_tl(x, amax_in_ptr, amax_ptr, partials, DELAYED, PARTIALS)
    scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
    q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        if not DELAYED:
            tl.store(amax_ptr, amax)
        tl.store(scale_ptr, scale)
        tl.store(inv_ptr, inverse_tl(scale))


@triton.jit
def _store_group_stats(amax_ptr, scale_ptr, inv_ptr, at, amax, scale, mask):
    tl.store(amax_ptr + at, amax, mask=mask)
    tl.store(scale_ptr + at, scale, mask=mask)
    tl.store(inv_ptr + at, inverse_tl(scale), mask=mask)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, amax_in_ptr, amax_ptr, scale_ptr, inv_ptr,
    R, C, stride_r, stride_c, scale_stride_r, scale_ub,
    FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr, HAS_AMAX_IN: tl.constexpr,
    WHOLE_TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, LOOP_C: tl.constexpr,
):  # fmt: skip
    """One scale per row of the tile (rows, 1x128 blocks) or per tile (128x128 blocks).

    Program (i, j) covers rows [i*BLOCK_R, ...) and columns [j*BLOCK_C, ...); the scale of its
    group sits at scale[i*BLOCK_R + r, j] (per row) or scale[i, j] (WHOLE_TILE). A row longer
    than the registers hold (LOOP_C) is read twice, once for its amax and once to quantize.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    if LOOP_C:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = row_ok[:, None] & (cols[None, :] < C)
            x = tl.load(
                x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0
            )
            amax = tl.maximum(amax, tl.max(finite_abs_tl(x), axis=1))
        if HAS_AMAX_IN:
            scale = scale_from_amax_tl(
                tl.load(amax_in_ptr + rows, mask=row_ok, other=0.0), FMT, POW2, HAS_UB, scale_ub
            )
        else:
            scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            m = row_ok[:, None] & (cols[None, :] < C)
            x = tl.load(
                x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0
            )
            q = saturate_cast_tl(x, scale[:, None], FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m)
        _store_group_stats(amax_ptr, scale_ptr, inv_ptr, rows, amax, scale, row_ok)
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.0)
        if WHOLE_TILE:
            amax = tl.max(tl.max(finite_abs_tl(x), axis=1), axis=0)
            at = pid_r * scale_stride_r + pid_c
            if HAS_AMAX_IN:
                scale = scale_from_amax_tl(tl.load(amax_in_ptr + at), FMT, POW2, HAS_UB, scale_ub)
            else:
                scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
            q = saturate_cast_tl(x, scale, FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            _store_group_stats(amax_ptr, scale_ptr, inv_ptr, at, amax, scale, True)
        else:
            amax = tl.max(finite_abs_tl(x), axis=1)
            at = rows * scale_stride_r + pid_c
            if HAS_AMAX_IN:
                scale = scale_from_amax_tl(
                    tl.load(amax_in_ptr + at, mask=row_ok, other=0.0), FMT, POW2, HAS_UB, scale_ub
                )
            else:
                scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
            q = saturate_cast_tl(x, scale[:, None], FMT, SOFT_FP8, q_ptr.dtype.element_ty)
            _store_group_stats(amax_ptr, scale_ptr, inv_ptr, at, amax, scale, row_ok)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m)


_AMAX_PARTIALS = Launcher(_amax_partials_kernel)
_QUANTIZE_TENSOR = Launcher(_quantize_tensor_kernel)
_QUANTIZE_GROUPS = Launcher(_quantize_groups_kernel)


def _num_warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _tile(R: int, C: int, target: int) -> tuple[int, int]:
    """A [BLOCK_R, BLOCK_C] tile of about `target` elements covering whole rows when it can."""
    block_c = min(next_pow2(max(C, 1)), target)
    block_r = min(next_pow2(max(R, 1)), max(1, target // block_c))
    return block_r, block_c


def _max_partials() -> int:
    # Enough programs to fill an H200 several times over; few under the interpreter, so that
    # its tests walk the multi-tile loop.
    return 4 if interpreting() else 1024


def _check_amax(
    amax: torch.Tensor | None, shape: tuple, device: torch.device
) -> torch.Tensor | None:
    if amax is None:
        return None
    if not isinstance(amax, torch.Tensor):
        raise TypeError(
            f"amax must be a float32 tensor of shape {shape}, got {type(amax).__name__}"
        )
    if amax.dtype != torch.float32 or tuple(amax.shape) != tuple(shape) or amax.device != device:
        raise ValueError(
            f"amax must be a float32 tensor of shape {shape} on {device}, "
            f"got {amax.dtype} {tuple(amax.shape)} on {amax.device}"
        )
    return amax.contiguous()


# QuantConfig per (fmt, granularity, block, pow2, scale_ub): validating a config costs more
# host time than a small quantization kernel runs.
_CONFIGS: dict[tuple, QuantConfig] = {}


def cached_config(
    fmt: str,
    granularity: str,
    block: tuple[int, int] | None,
    pow2: bool,
    scale_ub: float | None,
) -> QuantConfig:
    """`QuantConfig(fmt, granularity, block, pow2, scale_ub)`, validated once per value."""
    key = (fmt, granularity, block, pow2, scale_ub)
    try:
        return _CONFIGS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable block (a list); validate it
        pass
    config = QuantConfig(fmt, granularity, block, pow2, scale_ub)
    if type(pow2) is bool and isinstance(block, tuple | None) and len(_CONFIGS) < 1024:
        _CONFIGS[key] = config
    return config


def quantize(
    x: torch.Tensor,
    fmt: str = "e4m3",
    granularity: str = "row",
    *,
    block: tuple[int, int] | None = None,
    pow2: bool = False,
    scale_ub: float | None = None,
    amax: torch.Tensor | None = None,
) -> Fp8Tensor:
    """Quantize a 2-D bf16/fp16/fp32 tensor to FP8 with one scale per tensor, row or block.

    `block` is (1, 128) (default for 'block') or (128, 128). `amax`, shaped like the scales,
    replaces the measured amax when computing the scale (delayed scaling); the returned
    ``Fp8Tensor.amax`` is always the amax measured in `x`. Strided `x` is read in place.
    """
    return quantize_with(x, cached_config(fmt, granularity, block, pow2, scale_ub), amax)


def quantize_with(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> Fp8Tensor:
    """`quantize` with its options in a `QuantConfig` (what modules keep per operand)."""
    x = check_high_precision_2d(x)
    R, C = x.shape
    device = x.device
    amax_in = None if amax is None else _check_amax(amax, config.scale_shape(R, C), device)
    require_triton_device(x)
    if R == 0 or C == 0:
        return _quantize_empty(x, config, amax_in)
    # Everything the kernels specialize on: see loka.kernels.launch.
    key = (R, C, *x.stride(), x.dtype, config, aligned(x), amax_in is not None and aligned(amax_in))
    q = torch.empty((R, C), dtype=config.dtype, device=device)
    q_out = q.view(torch.uint8) if interpreting() else q
    if config.granularity == "tensor":
        return _quantize_tensor(x, q, q_out, config, amax_in, key)
    return _quantize_groups(x, q, q_out, config, amax_in, key)


@functools.lru_cache(maxsize=1024)
def _tensor_tiles(R: int, C: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_C, tiles along C, tiles, amax partials) of a tensorwise quantization."""
    br, bc = _tile(R, C, 1024 if interpreting() else 4096)
    tiles_c = cdiv(C, bc)
    tiles = cdiv(R, br) * tiles_c
    return br, bc, tiles_c, tiles, min(tiles, _max_partials())


def _launch_amax_partials(x: torch.Tensor, amax: torch.Tensor) -> None:
    """Partial amaxes of x into amax[1:] (see `_amax_partials_kernel`)."""
    R, C = x.shape
    br, bc, tiles_c, tiles, partials = _tensor_tiles(R, C)
    args = (x, amax, R, C, *x.stride(), tiles_c, tiles)
    key = (R, C, *x.stride(), x.dtype, aligned(x))
    plan = _AMAX_PARTIALS.lookup(key)
    if plan is None:
        meta = {"BLOCK_R": br, "BLOCK_C": bc}
        _AMAX_PARTIALS(key, (partials,), args, meta, num_warps=_num_warps(br * bc))
    else:
        _AMAX_PARTIALS.launch(plan, args)


def _quantize_tensor(
    x: torch.Tensor, q: torch.Tensor, q_out: torch.Tensor, config: QuantConfig, amax_in, key
) -> Fp8Tensor:
    R, C = x.shape
    br, bc, tiles_c, _, partials = _tensor_tiles(R, C)
    delayed = amax_in is not None
    has_ub, ub = ub_args(config.scale_ub)
    device = x.device
    if delayed:  # no amax pass: the quantizing kernel gathers the amax seen by atomic max
        partials = 0
        amax = torch.zeros(1, dtype=torch.float32, device=device)
    else:  # [amax, partial amaxes...]: the partials never leave this function
        amax = torch.empty(1 + partials, dtype=torch.float32, device=device)
        _launch_amax_partials(x, amax)
    scale = torch.empty(1, dtype=torch.float32, device=device)
    inv = torch.empty(1, dtype=torch.float32, device=device)
    args = (
        x,
        q_out,
        amax_in if delayed else amax,
        amax,
        scale,
        inv,
        R,
        C,
        *x.stride(),
        partials,
        ub,
    )
    plan = _QUANTIZE_TENSOR.lookup(key)
    if plan is None:
        meta = dict(
            FMT=FORMAT_IDS[config.fmt], SOFT_FP8=interpreting(), POW2=config.pow2,
            HAS_UB=has_ub, DELAYED=delayed, PARTIALS=next_pow2(max(partials, 1)),
            BLOCK_R=br, BLOCK_C=bc,
        )  # fmt: skip
        grid = (cdiv(R, br), tiles_c)
        _QUANTIZE_TENSOR(key, grid, args, meta, num_warps=_num_warps(br * bc))
    else:
        _QUANTIZE_TENSOR.launch(plan, args)
    if not delayed:
        amax = amax[:1]
    return Fp8Tensor._trusted(q, scale, inv, amax, config.fmt, "tensor")


@functools.lru_cache(maxsize=1024)
def _group_tiles(
    R: int, C: int, granularity: str, block: tuple[int, int] | None
) -> tuple[tuple[int, int], dict, int, int]:
    """(grid, tile constexprs, row stride of the scale grid, warps) of a row or block
    quantization."""
    if granularity == "row":
        loop_c = C > MAX_ROW_IN_REGISTERS
        target = ROW_TILE["elements"]
        br, bc = _tile(R, C, target if loop_c else max(target, next_pow2(C)))
        grid, whole, scale_stride = (cdiv(R, br), 1), False, 1
        if ROW_TILE["warps"]:
            return grid, _row_tile(whole, br, bc, loop_c), scale_stride, ROW_TILE["warps"]
    else:
        block_r, bc = block
        loop_c = False
        whole = block_r > 1
        br = block_r if whole else _tile(R, bc, 4096)[0]
        grid, scale_stride = (cdiv(R, br), cdiv(C, bc)), cdiv(C, bc)
    return grid, _row_tile(whole, br, bc, loop_c), scale_stride, _num_warps(br * bc)


def _row_tile(whole: bool, br: int, bc: int, loop_c: bool) -> dict:
    return {"WHOLE_TILE": whole, "BLOCK_R": br, "BLOCK_C": bc, "LOOP_C": loop_c}


def _quantize_groups(
    x: torch.Tensor, q: torch.Tensor, q_out: torch.Tensor, config: QuantConfig, amax_in, key
) -> Fp8Tensor:
    R, C = x.shape
    grid, tile, scale_stride, warps = _group_tiles(R, C, config.granularity, config.block)
    # Three tensors, not views of one: callers (custom ops) may not return aliased outputs.
    shape = config.scale_shape(R, C)
    device = x.device
    amax = torch.empty(shape, dtype=torch.float32, device=device)
    scale = torch.empty(shape, dtype=torch.float32, device=device)
    inv = torch.empty(shape, dtype=torch.float32, device=device)
    has_ub, ub = ub_args(config.scale_ub)
    args = (x, q_out, amax if amax_in is None else amax_in, amax, scale, inv,
            R, C, *x.stride(), scale_stride, ub)  # fmt: skip
    plan = _QUANTIZE_GROUPS.lookup(key)
    if plan is None:
        meta = dict(
            FMT=FORMAT_IDS[config.fmt], SOFT_FP8=interpreting(), POW2=config.pow2,
            HAS_UB=has_ub, HAS_AMAX_IN=amax_in is not None, **tile,
        )  # fmt: skip
        _QUANTIZE_GROUPS(key, grid, args, meta, num_warps=warps)
    else:
        _QUANTIZE_GROUPS.launch(plan, args)
    return Fp8Tensor._trusted(q, scale, inv, amax, config.fmt, config.granularity, config.block)


def _quantize_empty(x: torch.Tensor, config: QuantConfig, amax_in) -> Fp8Tensor:
    R, C = x.shape
    shape = config.scale_shape(R, C)
    seen = torch.zeros(shape, dtype=torch.float32, device=x.device)
    scale = scale_from_amax(seen if amax_in is None else amax_in, config.fmt, config.pow2,
                            config.scale_ub)  # fmt: skip
    q = torch.empty((R, C), dtype=config.dtype, device=x.device)
    return Fp8Tensor(q, scale, 1.0 / scale, seen, config.fmt, config.granularity, config.block)


def quantize_reference(
    x: torch.Tensor, config: QuantConfig, amax: torch.Tensor | None = None
) -> Fp8Tensor:
    """`quantize_with` in pure torch: `loka.schema.fp8.quantize_reference`, the definition
    the kernels are tested against, as an `Fp8Tensor`."""
    x = check_high_precision_2d(x)
    shape = config.scale_shape(*x.shape)
    data, scale, seen = schema_reference(x, config, _check_amax(amax, shape, x.device))
    return Fp8Tensor(data, scale, 1.0 / scale, seen, config.fmt, config.granularity, config.block)
