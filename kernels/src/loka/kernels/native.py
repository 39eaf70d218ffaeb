"""The torch-native FP8 backend: quantization written in plain torch ops feeding
``torch._scaled_mm``.

Nothing here is a Triton kernel or a custom op. Under ``torch.compile`` inductor sees every
operation, so the amax reduction, the scale, the saturating cast and the transposes that
the backward needs fuse into the elementwise work around them (the activation that feeds a
linear, the cast of a gradient) instead of costing launches and memory passes of their
own; and with no Python per call in the graph, ``mode="reduce-overhead"`` (CUDA graphs)
captures the whole step. The numerics are the reference ones (`loka.schema.fp8`), bit
for bit: the same scale rule, the same saturating round-to-nearest-even cast.

Supported: tensor and row granularity, dynamic scaling (current amax), power-of-two scales
and scale upper bounds. Delayed scaling keeps state between steps and block scaling has no
``_scaled_mm`` kernel here: both stay with the Triton backends.
On the CPU, where ``_scaled_mm`` takes tensor scales only, the GEMM is emulated in float32
(dequantize, multiply): the same products, for tests and the CPU demo.
"""

from __future__ import annotations

import torch

from loka.kernels.torch_gemm import scaled_mm_refusal
from loka.schema.formats import AMAX_FLOOR, FP8_MAX
from loka.schema.fp8 import finite_abs, fp8_dtype, saturate_cast, scale_from_amax

__all__ = [
    "NATIVE_ALIGN",
    "NATIVE_BACKEND",
    "NATIVE_CPU_BACKEND",
    "NATIVE_FAST_BACKEND",
    "native_mm",
    "native_refusal",
    "quantize_native",
    "saturate_cast_native",
]

NATIVE_BACKEND = "torch.native"
# The same with the tensor cores' fast accumulation (`_scaled_mm(use_fast_accum=True)`): a
# whole K summed in the tensor cores' reduced-precision accumulator, without the periodic
# promotion to float32. Faster (torchao's float8 recipes run their forward GEMM this way),
# but Probe's error bounds do not cover the accumulation error, so a plan takes it only when
# `PlanConfig.allow_fast_accum` says so. On the CPU (emulated GEMM) it is torch.native.
NATIVE_FAST_BACKEND = "torch.native.fast"
# The same on the CPU only, at any shape: there the GEMM is emulated, with no _scaled_mm and
# so no alignment rule; what `loka.dispatch.apply` runs FP8 passes on where Triton kernels
# would run in the interpreter (the CPU demo).
NATIVE_CPU_BACKEND = "torch.native.cpu"
NATIVE_GRANULARITIES = ("tensor", "row")
# torch._scaled_mm needs the contracted dim and the output's columns in multiples of 16.
NATIVE_ALIGN = 16


def native_refusal(
    a_fmt: str, b_fmt: str, granularity: str, scaling: str = "dynamic"
) -> str | None:
    """Why the native backend cannot run a pass with these operands (None when it can)."""
    if scaling != "dynamic":
        return f"{NATIVE_BACKEND}: {scaling} scaling keeps state across steps; dynamic only"
    if granularity not in NATIVE_GRANULARITIES:
        return f"{NATIVE_BACKEND}: granularity {granularity!r} not supported (tensor, row)"
    reason = scaled_mm_refusal(a_fmt, b_fmt, granularity, torch.bfloat16)
    return None if reason is None else f"{NATIVE_BACKEND}: {reason}"


def quantize_native(
    t: torch.Tensor,
    fmt: str,
    granularity: str,
    *,
    pow2: bool = False,
    scale_ub: float | None = None,
    transpose: bool = False,
    rows_vary: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, inv_scale)`` of a 2-D `t` ``[R, C]`` quantized as a GEMM's first operand.

    Row granularity takes one scale per row of the operand as the GEMM reads it: per row of
    `t`, or with `transpose` per row of ``t^T`` (a column of `t`), and then `data` is the
    contiguous ``t^T`` ``[C, R]``. `inv_scale` is ``[rows, 1]`` for rows, ``[]`` for a tensor.

    `rows_vary`: R is a token count, which a compiled graph may hold symbolic (jagged
    batches). Under torch.compile the tensor amax is then taken per row first (over the
    fixed C), then over the rows: the same value bit for bit, and inductor's reduction over
    a symbolic R ran 2-2.3x slower than over static C on the H200 (32320 x 12288: 1.14 ms
    one-stage vs 0.53 ms two-stage; `bench/results/native_dynamic_20261202T170340Z.json`).
    """
    if granularity not in NATIVE_GRANULARITIES:
        raise ValueError(f"{NATIVE_BACKEND}: granularity {granularity!r} not supported")
    if torch.compiler.is_compiling():
        data, scale = _quantize_traced(t, fmt, granularity, pow2, scale_ub, transpose, rows_vary)
    else:
        t32 = t.float()  # once for the amax and the cast: a launch fewer per call
        a = finite_abs(t32)
        if granularity == "tensor":
            amax = a.amax()
        else:
            amax = a.amax(dim=0 if transpose else 1, keepdim=True)
        scale = scale_from_amax(amax, fmt, pow2, scale_ub, finite=True)
        del a
        data = saturate_cast(t32, scale, fmt)
    inv = scale.reciprocal()
    if transpose:
        data = data.t().contiguous()
        if granularity == "row":
            inv = inv.t()
    return data, inv.contiguous()


def _quantize_traced(
    t: torch.Tensor,
    fmt: str,
    granularity: str,
    pow2: bool,
    scale_ub: float | None,
    transpose: bool,
    rows_vary: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(data, scale)` as written for inductor: the same bits as the eager ops, in the
    formulation inductor fused well. The eager path was cut to fewer ops for host time
    (3033ad4: one float32 copy for amax and cast, `nan_to_num`, `clamp`, `full_like`
    constants); traced, that leaner graph let inductor fuse HSTU xl's quantization after
    the SiLU backward into a neighbouring looped reduction (1.33 -> 3.48 ms a call, 3 a
    step) and the planned step fell from 1.097x to 1.061-1.066x bf16
    (`bench/results/realized_20261202T172455Z_profiles` against `..081536Z_profiles`).
    A long token row's amax taken over 1024-column chunks first did not help there either:
    one HSTU xl layer ran 1.054x bf16 with it against 1.076x without (the chunk-amax kernel
    and a cast that recomputes the producer cost more than the one looped reduction;
    `bench/results/bias_grad_layer_20261203T233414Z.json`)."""
    a = t.float().abs()
    a = torch.where(a < float("inf"), a, torch.zeros_like(a))
    if granularity == "tensor":
        amax = a.amax(dim=1).amax() if rows_vary else a.amax()
    else:
        amax = a.amax(dim=0 if transpose else 1, keepdim=True)
    valid = (amax > 0) & (amax < float("inf"))
    fp8_max = torch.tensor(FP8_MAX[fmt], dtype=torch.float32, device=amax.device)
    scale = torch.where(valid, fp8_max / amax.clamp_min(AMAX_FLOOR), torch.ones_like(amax))
    if scale_ub is not None:
        scale = torch.minimum(
            scale, torch.tensor(scale_ub, dtype=torch.float32, device=amax.device)
        )
    if pow2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return _saturate_traced(t, scale, fmt), scale


def _saturate_traced(t: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    m = FP8_MAX[fmt]
    t32 = t.float()
    y = t32 * scale
    y = torch.where(y > m, m, torch.where(y < -m, -m, y))
    return torch.where(t32.isinf(), float("nan"), y).to(fp8_dtype(fmt))


def saturate_cast_native(t: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """`saturate(t * scale)` in FP8 (`loka.schema.fp8.saturate_cast`'s bits): the eager
    path's one clamp, or under torch.compile the formulation `quantize_native` traces."""
    if torch.compiler.is_compiling():
        return _saturate_traced(t, scale, fmt)
    return saturate_cast(t, scale, fmt)


def native_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a / sa) @ (b / sb)^T (+ bias)`` for FP8 ``a [M, K]`` and ``b [N, K]`` (both
    row-major, as `quantize_native` makes them), inverse scales ``[M, 1]``/``[N, 1]`` (row)
    or ``[]`` (tensor); `fast_accum` (GPU only) accumulates in the tensor cores' precision."""
    row = a_inv.dim() == 2
    scale_b = b_inv.t() if row else b_inv
    if a.device.type == "cuda":
        fuse_bias = bias is not None and bias.dtype == out_dtype == torch.bfloat16
        y = torch._scaled_mm(
            a, b.t(), scale_a=a_inv, scale_b=scale_b, bias=bias if fuse_bias else None,
            out_dtype=out_dtype, use_fast_accum=fast_accum,
        )  # fmt: skip
        if bias is not None and not fuse_bias:
            y = (y.float() + bias.float()).to(out_dtype)
        return y
    y = (a.float() @ b.float().t()) * a_inv * scale_b
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
