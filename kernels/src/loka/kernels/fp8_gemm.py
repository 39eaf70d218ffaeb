"""Triton FP8 GEMM ``out = act(a @ b^T * scales + bias)`` with tensor, row or block scales.

Both operands are K-contiguous (``a[M, K]``, ``b[N, K]``), the layout Hopper's FP8 tensor
cores read without a transpose. Tensor and row scales are applied once in the epilogue,
in the order that keeps a finite product finite (`scale_product_tl`); block scales (1x128 or 128x128, along K in steps of 128) are applied to each K step's
partial product before it joins the float32 accumulator, as in DeepSeek-V3. Without
``fast_accum`` the tensor cores' partial sums are promoted to float32 every BLOCK_K (<= 128)
products; with it they accumulate at the tensor cores' reduced precision for the whole K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.epilogue import ACTIVATION_IDS, activation_tl, apply_epilogue, check_bias
from loka.kernels.formats import check_activation, check_out_dtype
from loka.kernels.fp8_bits import FORMAT_IDS, fp8_decode_tl
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.launch import Launcher
from loka.kernels.runtime import (
    FP8_MIN_CAPABILITY,
    aligned,
    autotuning,
    cdiv,
    interpreting,
    next_pow2,
    require_triton_device,
)

__all__ = [
    "mm_reference",
    "triton_fp8_mm",
]

SCALE_MODES = {"tensor": 0, "row": 1, "block": 2}
SCALE_BLOCK_K = 128


@triton.jit
def _load_scale_rows(scale_ptr, offs, limit, MODE: tl.constexpr):
    """Epilogue scales of a tile's rows: one value (tensor) or one per row."""
    if MODE == 0:
        return tl.load(scale_ptr)
    else:
        return tl.load(scale_ptr + offs, mask=offs < limit, other=0.0)


@triton.jit
def scale_product_tl(acc, sa, sb):
    """``acc * sa * sb`` for positive scales, in an order that leaves float32's range only
    where the result does: the inverse scale of a huge operand (x ~ 1e36 gives ~2e33) times
    the accumulator overflows although the other operand's small scale would bring the
    product back. The larger scale goes first unless that overflows; then the smaller."""
    big = tl.maximum(sa, sb)
    small = tl.minimum(sa, sb)
    high = acc * big
    return tl.where(tl.abs(high) <= 3.4028234663852886e38, high * small, (acc * small) * big)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, M_BUCKET, stride_am, stride_bn, stride_cm,
    a_scale_stride, a_scale_kstride, b_scale_stride, b_scale_kstride,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr,
    A_BLOCK_ROWS: tl.constexpr, B_BLOCK_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, FAST_ACCUM: tl.constexpr,
    SOFT_FP8: tl.constexpr, A_FMT: tl.constexpr, B_FMT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Tiles sharing a band of GROUP_M rows of `a` run together so `b` stays in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SOFT_FP8:  # the interpreter's FP8 casts are inexact: decode the bytes ourselves
            a = fp8_decode_tl(a, A_FMT)
            b = fp8_decode_tl(b, B_FMT)
        if (A_SCALE == 2) or (B_SCALE == 2):
            part = tl.dot(a, tl.trans(b))
            kb = k0 // 128
            if A_SCALE == 2:
                sa = tl.load(
                    a_scale_ptr + (offs_m // A_BLOCK_ROWS) * a_scale_stride + kb * a_scale_kstride,
                    mask=m_ok,
                    other=0.0,
                )
                part = part * sa[:, None]
            if B_SCALE == 2:
                sb = tl.load(
                    b_scale_ptr + (offs_n // B_BLOCK_ROWS) * b_scale_stride + kb * b_scale_kstride,
                    mask=n_ok,
                    other=0.0,
                )
                part = part * sb[None, :]
            acc += part
        elif FAST_ACCUM:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if (A_SCALE != 2) and (B_SCALE != 2):
        sa = _load_scale_rows(a_scale_ptr, offs_m, M, A_SCALE)
        sb = _load_scale_rows(b_scale_ptr, offs_n, N, B_SCALE)
        acc = scale_product_tl(
            acc, sa[:, None] if A_SCALE == 1 else sa, sb[None, :] if B_SCALE == 1 else sb
        )
    elif A_SCALE != 2:
        sa = _load_scale_rows(a_scale_ptr, offs_m, M, A_SCALE)
        acc = acc * (sa[:, None] if A_SCALE == 1 else sa)
    elif B_SCALE != 2:
        sb = _load_scale_rows(b_scale_ptr, offs_n, N, B_SCALE)
        acc = acc * (sb[None, :] if B_SCALE == 1 else sb)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = activation_tl(acc, ACTIVATION)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs() -> list[triton.Config]:
    shapes = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: Hopper FP8 tiles for LRM shapes
        (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 3), (128, 128, 128, 8, 4),
        (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (64, 64, 128, 4, 5),
    ]  # fmt: skip
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s
        )
        for bm, bn, bk, w, s in shapes
    ]


# Tiles whose registers spill (more than a few bytes) in ptxas for sm_90a with Triton 3.6:
# float32 promotion keeps a second accumulator, and block scales a third product. (256, 128)
# with plain promotion spills 4 bytes and is the fastest plain tile on an H200.
_SPILLING = {("plain", 128, 256, 8), ("block", 128, 256, 8), ("block", 256, 128, 8)}


def _spills(config: triton.Config, fast_accum: bool, block_scales: bool) -> bool:
    kind = "block" if block_scales else "fast" if fast_accum else "plain"
    return (kind, config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps) in _SPILLING


def _prune(configs, named_args, **kwargs):
    """Drop tiles much larger than the problem (they only add masked work), and tiles that
    spill registers for this accumulation."""
    m = max(64, next_pow2(named_args["M"]))
    n = max(64, next_pow2(named_args["N"]))
    block = 2 in (kwargs.get("A_SCALE"), kwargs.get("B_SCALE"))
    fast = bool(kwargs.get("FAST_ACCUM"))
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= m and c.kwargs["BLOCK_N"] <= n and not _spills(c, fast, block)
    ]
    return kept or configs[:1]


def _interpreter_tile(M: int, N: int) -> dict:
    bm = min(64, max(16, next_pow2(M)))
    bn = min(64, max(16, next_pow2(N)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}


# The tile launched without autotuning (LOKA_KERNELS_AUTOTUNE=0), per accumulation: "plain"
# (float32 promotion every K step), "fast", "block" (block scales). Measured on an H200
# (bench/kernels.py --sections tune).
HEURISTIC_TILES: dict[str, tuple[int, int, int, int, int]] = {  # BLOCK_M, N, K, warps, stages
    "plain": (256, 128, 128, 8, 3),
    "fast": (128, 256, 128, 8, 3),
    "block": (128, 128, 128, 8, 3),
}


def _heuristic_tile(M: int, N: int, kind: str) -> dict:
    if M < 128 or N < 128:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 3
    else:
        bm, bn, bk, warps, stages = HEURISTIC_TILES[kind]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages}  # fmt: skip


def _quick_bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=15, quantiles=quantiles)


_fp8_gemm_autotuned = triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "A_SCALE", "B_SCALE", "HAS_BIAS", "ACTIVATION", "FAST_ACCUM"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_quick_bench,
)(_fp8_gemm_kernel)


_FP8_GEMM = Launcher(_fp8_gemm_kernel)
_FP8_GEMM_TUNED = Launcher(_fp8_gemm_autotuned)

# 1x128 block scales are read K-block-major (one contiguous run of rows per K step) instead
# of gathered with a stride of K/128 floats per row: see `_scale_args`.
TRANSPOSE_ROW_BLOCK_SCALES = True


def _scale_args(t: Fp8Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(scales, mode, rows per scale block, row stride, K-block stride) of an operand."""
    s = t.inv_scale
    if t.granularity != "block":
        return s, SCALE_MODES[t.granularity], 1, 0, 0
    if t.block[0] == 1 and TRANSPOSE_ROW_BLOCK_SCALES and not interpreting():
        # One small copy ([rows, K/128] floats) makes every K step's scale load coalesced.
        s = s.t().contiguous()
        return s, SCALE_MODES["block"], 1, 1, s.stride(0)
    return s, SCALE_MODES["block"], t.block[0], s.stride(0), s.stride(1)


def check_fp8_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name} must be an Fp8Tensor (use quantize), got {type(t).__name__}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a is [M, K] = {tuple(a.shape)} and b is [N, K] = {tuple(b.shape)}: K differs"
        )
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} and b on {b.device}")
    for name, t in (("a", a), ("b", b)):
        if t.granularity == "block" and t.block[1] != SCALE_BLOCK_K:
            raise ValueError(
                f"{name}: block scales must span {SCALE_BLOCK_K} along K, got {t.block}"
            )


def check_fp8_request(
    a: Fp8Tensor,
    b: Fp8Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """Validate an FP8 GEMM request; returns the bias, contiguous."""
    check_fp8_operands(a, b)
    check_activation(activation)
    check_out_dtype(out_dtype)
    return check_bias(bias, b.shape[0], a.device)


def triton_fp8_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    tile: dict | None = None,
) -> torch.Tensor:
    """``activation(dequant(a) @ dequant(b).T + bias)`` in `out_dtype`, one Triton kernel.

    `tile` fixes the tile (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), for
    benchmarks comparing tiles; None autotunes (the heuristic tile with
    LOKA_KERNELS_AUTOTUNE=0).
    """
    bias = check_fp8_request(a, b, bias, activation, out_dtype)
    (M, K), (N, _) = a.shape, b.shape
    require_triton_device(a.data, b.data, min_capability=FP8_MIN_CAPABILITY)
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    sa, a_mode, a_rows, a_ss, a_ks = _scale_args(a)
    sb, b_mode, b_rows, b_ss, b_ks = _scale_args(b)
    soft = interpreting()
    args = (
        a.data.view(torch.uint8) if soft else a.data,
        b.data.view(torch.uint8) if soft else b.data,
        out, sa, sb, out if bias is None else bias,
        M, N, K, next_pow2(M), a.data.stride(0), b.data.stride(0), out.stride(0),
        a_ss, a_ks, b_ss, b_ks,
    )  # fmt: skip
    tuned = not soft and autotuning() and tile is None
    launcher = _FP8_GEMM_TUNED if tuned else _FP8_GEMM
    key = (
        None if tile is None else tuple(tile.items()), M, N, K, a.data.stride(0), b.data.stride(0), a.fmt, b.fmt, a_mode, b_mode, a_rows,
        b_rows, a_ss, a_ks, b_ss, b_ks, out_dtype, activation, fast_accum, aligned(a.data),
        aligned(b.data), aligned(sa), aligned(sb), None if bias is None else (bias.dtype, aligned(bias)),
    )  # fmt: skip
    plan = launcher.lookup(key)
    if plan is not None:
        launcher.launch(plan, args)
        return out
    meta = dict(
        A_SCALE=a_mode, B_SCALE=b_mode, A_BLOCK_ROWS=a_rows, B_BLOCK_ROWS=b_rows,
        HAS_BIAS=bias is not None, ACTIVATION=ACTIVATION_IDS[activation], FAST_ACCUM=fast_accum,
        SOFT_FP8=soft, A_FMT=FORMAT_IDS[a.fmt], B_FMT=FORMAT_IDS[b.fmt],
    )  # fmt: skip
    if tuned:

        def grid(meta):
            return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

        launcher(key, grid, args, meta)
    else:
        # One tile: the interpreter's (autotuning it would only cost time), or a heuristic one.
        kind = "block" if 2 in (a_mode, b_mode) else "fast" if fast_accum else "plain"
        cfg = (
            dict(tile) if tile else _interpreter_tile(M, N) if soft else _heuristic_tile(M, N, kind)
        )
        options = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        launcher(key, grid, args, {**meta, **cfg}, **options)
    return out


def mm_reference(
    a: Fp8Tensor | torch.Tensor,
    b: Fp8Tensor | torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Pure-torch ``activation(a @ b.T + bias)``: operands dequantized (float32, ``q / scale``)
    or taken as they are, product and epilogue in float64, result cast to `out_dtype`."""

    def wide(t: Fp8Tensor | torch.Tensor) -> torch.Tensor:
        return (t.dequantize() if isinstance(t, Fp8Tensor) else t.float()).double()

    y = wide(a) @ wide(b).T
    return apply_epilogue(y, None if bias is None else bias.double(), activation).to(out_dtype)
