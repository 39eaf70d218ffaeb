"""Persistent FP8 GEMM with TMA loads (Hopper): ``out = act(a @ b^T * scales + bias)``.

One program per SM walks the output tiles (grouped along M for L2 reuse); tiles of `a`, `b`
and `out` move through tensor descriptors (the TMA unit), which also zero-fill the edges,
so there are no masks in the K loop. Tensor and row scales, bias and activation are applied
in the epilogue. TMA needs 16-byte aligned rows: K a multiple of 16, and N a multiple of 8
(bf16 out) or 4 (float32 out). Same math as `fp8_gemm.triton_fp8_mm`, whose reference
(`mm_reference`) this kernel is tested against.

Host-side tensor descriptors (`triton.tools.tensor_descriptor`) came with Triton 3.4: they
are imported when the kernel is launched, so that loka.kernels imports on older Triton, where
this backend refuses (`tma_refusal`) and the others run.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import triton
import triton.language as tl

from loka.kernels.epilogue import ACTIVATION_IDS, activation_tl
from loka.kernels.fp8_bits import FORMAT_IDS, fp8_decode_tl
from loka.kernels.fp8_gemm import SCALE_MODES, check_fp8_request, scale_product_tl
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.launch import Launcher
from loka.kernels.runtime import (
    aligned,
    autotuning,
    cdiv,
    interpreting,
    next_pow2,
    require_triton_device,
)


@triton.jit
def _tile_coords(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % width) % group_size, (tile % width) // group_size


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr, M, N, K, M_BUCKET,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, FAST_ACCUM: tl.constexpr, SOFT_FP8: tl.constexpr,
    A_FMT: tl.constexpr, B_FMT: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            if SOFT_FP8:  # interpreter: decode the bytes (its own FP8 casts are inexact)
                a = fp8_decode_tl(a, A_FMT)
                b = fp8_decode_tl(b, B_FMT)
            if FAST_ACCUM:
                acc = tl.dot(a, b.T, acc)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if A_SCALE == 0:
            sa = tl.load(a_scale_ptr)
        else:
            sa = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        if B_SCALE == 0:
            sb = tl.load(b_scale_ptr)
        else:
            sb = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        acc = scale_product_tl(acc, sa, sb)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        acc = activation_tl(acc, ACTIVATION)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def _set_block_shapes(nargs: dict) -> None:
    """Descriptors carry their tile shape: set it for the config being run."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    nargs["c_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


def _configs() -> list[triton.Config]:
    shapes = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4),
              (128, 128, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4)]  # fmt: skip
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_block_shapes,
        )
        for bm, bn, bk, w, s in shapes
    ]


def _quick_bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=15, quantiles=quantiles)


def _prune(configs, named_args, **kwargs):
    """Drop the tile whose float32-promotion accumulators spill registers (ptxas, sm_90a)."""
    if kwargs.get("FAST_ACCUM"):
        return configs
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) != (128, 256)]


_fp8_gemm_tma_autotuned = triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "A_SCALE", "B_SCALE", "HAS_BIAS", "ACTIVATION", "FAST_ACCUM"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_quick_bench,
)(_fp8_gemm_tma_kernel)
_TMA = Launcher(_fp8_gemm_tma_kernel)
_TMA_TUNED = Launcher(_fp8_gemm_tma_autotuned)


# The tile launched without autotuning, by fast accumulation (False/True): BLOCK_M, N, K,
# warps, stages. Measured on an H200 (bench/kernels.py --sections tune).
DEFAULT_TILES: dict[bool, tuple[int, int, int, int, int]] = {
    False: (256, 128, 128, 8, 3),
    True: (128, 256, 128, 8, 3),
}


def _default_tile(soft: bool, fast_accum: bool) -> dict:
    if soft:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8}
    bm, bn, bk, warps, stages = DEFAULT_TILES[fast_accum]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages}  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


TMA_MIN_TRITON = "3.4"


@functools.cache
def tma_supported() -> bool:
    """Whether this Triton has host-side tensor descriptors (Triton >= 3.4)."""
    try:
        return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None
    except (ImportError, ValueError):
        return False


def _tensor_descriptor():
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor


def tma_refusal(k: int, n: int, out_dtype: torch.dtype) -> str | None:
    """Why TMA cannot address these operands (None when it can)."""
    if not tma_supported():
        return (
            f"the TMA GEMM needs triton>={TMA_MIN_TRITON} (host tensor descriptors), "
            f"found {triton.__version__}"
        )
    if k % 16:
        return f"TMA needs K a multiple of 16 (16-byte FP8 rows), got K={k}"
    per_16_bytes = 16 // torch.empty((), dtype=out_dtype).element_size()
    if n % per_16_bytes:
        return f"TMA needs N a multiple of {per_16_bytes} for {out_dtype} output, got N={n}"
    return None


def triton_fp8_mm_tma(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    tile: dict | None = None,
) -> torch.Tensor:
    """`triton_fp8_mm` for tensor or row scales, as a persistent TMA kernel (`tile` as
    there)."""
    bias = check_fp8_request(a, b, bias, activation, out_dtype)
    for name, t in (("a", a), ("b", b)):
        if t.granularity not in ("tensor", "row"):
            raise ValueError(
                f"{name}: the TMA GEMM takes tensor or row scales, not {t.granularity!r}"
            )
    (M, K), (N, _) = a.shape, b.shape
    reason = tma_refusal(K, N, out_dtype)
    if reason is not None:
        raise ValueError(reason)
    TensorDescriptor = _tensor_descriptor()
    require_triton_device(a.data, b.data, min_capability=(9, 0))
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    soft = interpreting()
    a_data = a.data.view(torch.uint8) if soft else a.data
    b_data = b.data.view(torch.uint8) if soft else b.data
    num_sms = 4 if soft else _num_sms(a.device.index or 0)
    scalars = (a.inv_scale, b.inv_scale, out if bias is None else bias, M, N, K)
    scalars += (next_pow2(M),)
    tuned = not soft and autotuning() and tile is None
    launcher = _TMA_TUNED if tuned else _TMA
    key = (
        None if tile is None else tuple(tile.items()), M, N, K, a.fmt, b.fmt, a.granularity, b.granularity, out_dtype, activation, fast_accum,
        aligned(a.inv_scale), aligned(b.inv_scale),
        None if bias is None else (bias.dtype, aligned(bias)),
    )  # fmt: skip
    plan = launcher.lookup(key)
    if plan is not None:  # descriptors carry the plan's tile shape
        bm, bn, bk = plan.meta["BLOCK_M"], plan.meta["BLOCK_N"], plan.meta["BLOCK_K"]
        descs = (
            TensorDescriptor.from_tensor(a_data, [bm, bk]),
            TensorDescriptor.from_tensor(b_data, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]),
        )
        launcher.launch(plan, (*descs, *scalars))
        return out
    # Placeholder tile shapes: each config's pre_hook (or the fixed tile below) sets them.
    descs = {
        "a_desc": TensorDescriptor.from_tensor(a_data, [16, 16]),
        "b_desc": TensorDescriptor.from_tensor(b_data, [16, 16]),
        "c_desc": TensorDescriptor.from_tensor(out, [16, 16]),
    }
    meta = dict(
        A_SCALE=SCALE_MODES[a.granularity], B_SCALE=SCALE_MODES[b.granularity],
        HAS_BIAS=bias is not None, ACTIVATION=ACTIVATION_IDS[activation], FAST_ACCUM=fast_accum,
        SOFT_FP8=soft, A_FMT=FORMAT_IDS[a.fmt], B_FMT=FORMAT_IDS[b.fmt], NUM_SMS=num_sms,
    )  # fmt: skip
    args = (*descs.values(), *scalars)

    def grid(cfg):
        return (min(num_sms, cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])),)

    if tuned:
        launcher(key, grid, args, meta)
    else:
        tile = dict(tile) if tile else _default_tile(soft, fast_accum)
        options = {k: tile.pop(k) for k in ("num_warps", "num_stages") if k in tile}
        _set_block_shapes({**descs, **tile})
        launcher(key, grid(tile), args, {**meta, **tile}, **options)
    return out
