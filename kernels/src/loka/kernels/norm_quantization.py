"""LayerNorm / RMSNorm fused with rowwise FP8 quantization of their output, and the backward.

Forward, one read of each row: mean (LayerNorm) and rstd, the normalized and affine output
``y``, its amax, scale and FP8 bytes; ``y`` itself is written only when asked (for a residual
or a bf16 consumer). Backward: ``dx`` per row, and ``dweight``/``dbias`` reduced from per-
program partial sums (deterministic). Quantization is treated as identity in the backward
(straight-through), the usual convention for FP8 training.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loka.kernels.formats import check_high_precision_2d
from loka.kernels.fp8_bits import FORMAT_IDS
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.launch import Launcher
from loka.kernels.quantization import cached_config, quantize_reference
from loka.kernels.runtime import aligned, cdiv, interpreting, next_pow2, require_triton_device
from loka.kernels.scaling import (
    finite_abs_tl,
    inverse_tl,
    saturate_cast_tl,
    scale_from_amax_tl,
    ub_args,
)
from loka.schema import QuantConfig

__all__ = [
    "MAX_ROW",
    "NormQuantized",
    "norm_backward",
    "norm_quantize",
    "norm_quantize_reference",
    "norm_reference",
]

KINDS = ("layernorm", "rmsnorm")
MAX_ROW = 16384  # a row is normalized from registers


class NormQuantized(NamedTuple):
    q: Fp8Tensor  # the normalized output, FP8 with one scale per row
    normed: torch.Tensor | None  # the same output in x's dtype, when asked for
    mean: torch.Tensor | None  # float32 [M] (LayerNorm only): saved for the backward
    rstd: torch.Tensor  # float32 [M]: saved for the backward


@triton.jit
def _norm_quantize_kernel(
    x_ptr, w_ptr, b_ptr, q_ptr, y_ptr, mean_ptr, rstd_ptr, amax_ptr, scale_ptr, inv_ptr,
    M, N, stride_x, eps, scale_ub,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, WRITE_Y: tl.constexpr,
    FMT: tl.constexpr, SOFT_FP8: tl.constexpr, POW2: tl.constexpr, HAS_UB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    r_ok = rows < M
    c_ok = cols < N
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=r_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(rstd_ptr + rows, rstd, mask=r_ok)
    if WRITE_Y:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    amax = tl.max(tl.where(mask, finite_abs_tl(y), 0.0), axis=1)
    scale = scale_from_amax_tl(amax, FMT, POW2, HAS_UB, scale_ub)
    q = saturate_cast_tl(y, scale[:, None], FMT, SOFT_FP8, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    tl.store(amax_ptr + rows, amax, mask=r_ok)
    tl.store(scale_ptr + rows, scale, mask=r_ok)
    tl.store(inv_ptr + rows, inverse_tl(scale), mask=r_ok)


_NORM_QUANTIZE = Launcher(_norm_quantize_kernel)


@triton.jit
def _norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    M, N, stride_dy, stride_x, rows_per_program,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program p handles rows [p*rows_per_program, ...) and writes its dw/db partial sums."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    c_ok = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, M)):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=c_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=c_ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd if RMS else tl.where(c_ok, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = dy * w if HAS_W else dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + row64 * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=c_ok)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(dw_part_ptr + pid * N + cols, dw, mask=c_ok)
    if HAS_B:
        tl.store(db_part_ptr + pid * N + cols, db, mask=c_ok)


def _check_norm_args(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, kind: str
) -> None:
    check_high_precision_2d(x)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    N = x.shape[1]
    if N > MAX_ROW:
        raise ValueError(f"rows of {N} elements exceed the fused kernel's {MAX_ROW}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.shape != (N,) or p.device != x.device or not p.is_floating_point()):
            raise ValueError(
                f"{name} must be a float tensor of shape [{N}] on {x.device}, got "
                f"{p.dtype} {tuple(p.shape)} on {p.device}"
            )


def _rows_tile(N: int) -> tuple[int, int, int]:
    block_n = next_pow2(max(N, 1))
    block_m = max(1, min(16, 4096 // block_n))
    return block_m, block_n, 4 if block_m * block_n <= 2048 else 8


def norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    kind: str = "layernorm",
    fmt: str = "e4m3",
    pow2: bool = False,
    scale_ub: float | None = None,
    return_normed: bool = False,
) -> NormQuantized:
    """Normalize the rows of ``x[M, N]`` (LayerNorm or RMSNorm, optional affine weight and
    bias) and quantize the result to FP8 with one scale per row, in one kernel."""
    _check_norm_args(x, weight, bias, kind)
    config = cached_config(fmt, "row", None, pow2, scale_ub)
    x = x if x.stride(1) == 1 else x.contiguous()
    require_triton_device(x)
    M, N = x.shape
    dev = x.device
    q = torch.empty((M, N), dtype=config.dtype, device=dev)
    # Separate tensors, not views of one buffer: callers (custom ops) may not return aliases.
    amax, scale, inv, rstd = (torch.empty(M, dtype=torch.float32, device=dev) for _ in range(4))
    mean = None if kind == "rmsnorm" else torch.empty(M, dtype=torch.float32, device=dev)
    normed = torch.empty_like(x) if return_normed else None
    if M and N:
        soft = interpreting()
        has_ub, ub = ub_args(config.scale_ub)
        args = (
            x, x if weight is None else weight, x if bias is None else bias,
            q.view(torch.uint8) if soft else q, x if normed is None else normed,
            rstd if mean is None else mean, rstd, amax, scale, inv, M, N, x.stride(0), float(eps), ub,
        )  # fmt: skip
        key = (
            M, N, x.stride(0), x.dtype, kind, config, return_normed, aligned(x),
            None if weight is None else (weight.dtype, aligned(weight)),
            None if bias is None else (bias.dtype, aligned(bias)),
        )  # fmt: skip
        plan = _NORM_QUANTIZE.lookup(key)
        if plan is None:
            block_m, block_n, warps = _rows_tile(N)
            meta = dict(
                RMS=kind == "rmsnorm", HAS_W=weight is not None, HAS_B=bias is not None,
                WRITE_Y=return_normed, FMT=FORMAT_IDS[fmt], SOFT_FP8=soft, POW2=pow2,
                HAS_UB=has_ub, BLOCK_M=block_m, BLOCK_N=block_n,
            )  # fmt: skip
            _NORM_QUANTIZE(key, (cdiv(M, block_m),), args, meta, num_warps=warps)
        else:
            _NORM_QUANTIZE.launch(plan, args)
    elif M:
        amax.zero_(), scale.fill_(1.0), inv.fill_(1.0), rstd.fill_(1.0 / float(eps) ** 0.5)
        if mean is not None:
            mean.zero_()
    q8 = Fp8Tensor._trusted(q, scale, inv, amax, fmt, "row")
    return NormQuantized(q8, normed, mean, rstd)


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    kind: str = "layernorm",
    has_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) of the norm given ``dy`` = dLoss/d(normed output) and the saved
    mean (LayerNorm) and rstd; dweight is None without a weight, dbias None unless `has_bias`."""
    _check_norm_args(x, weight, None, kind)
    check_high_precision_2d(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} differ in shape")
    M, N = x.shape
    if rstd.shape != (M,) or (kind == "layernorm" and (mean is None or mean.shape != (M,))):
        raise ValueError("mean (LayerNorm) and rstd must be the float32 [M] the forward saved")
    x = x if x.stride(1) == 1 else x.contiguous()
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    require_triton_device(x, dy)
    dx = torch.empty_like(x)
    if interpreting():
        programs = max(1, min(M, 4))
    else:
        programs = max(
            1, min(M, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
        )
    rows_per_program = cdiv(max(M, 1), programs)
    parts = torch.zeros((2, programs, N), dtype=torch.float32, device=x.device)
    if M and N:
        block_n = next_pow2(N)
        _norm_backward_kernel[(programs,)](
            dy, x, weight if weight is not None else x, mean if mean is not None else rstd, rstd,
            dx, parts[0], parts[1], M, N, dy.stride(0), x.stride(0), rows_per_program,
            RMS=kind == "rmsnorm", HAS_W=weight is not None, HAS_B=has_bias, BLOCK_N=block_n,
            num_warps=4 if block_n <= 1024 else 8,
        )  # fmt: skip
    dw = parts[0].sum(0).to(weight.dtype) if weight is not None else None
    db = parts[1].sum(0).to(weight.dtype if weight is not None else x.dtype) if has_bias else None
    return dx, dw, db


def norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    kind: str = "layernorm",
) -> torch.Tensor:
    """Pure torch, float32: the normalized, affine output (differentiable, for the backward)."""
    _check_norm_args(x, weight, bias, kind)
    xf = x.float()
    if kind == "layernorm":
        xf = xf - xf.mean(dim=1, keepdim=True)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def norm_quantize_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    kind: str = "layernorm",
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, Fp8Tensor]:
    """Pure torch: (float32 normalized output, its rowwise quantization)."""
    y = norm_reference(x, weight, bias, eps, kind=kind)
    return y, quantize_reference(y, config or QuantConfig("e4m3", "row"))
