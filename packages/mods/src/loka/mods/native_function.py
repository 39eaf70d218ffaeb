"""The autograd function of an `Fp8Linear` on the torch-native backend (``torch.native``).

Every FP8 pass quantizes its operands with plain torch ops and multiplies with
``torch._scaled_mm`` (`loka.kernels.native`); nothing is cached between calls and nothing
runs in Python per call beyond building the graph. That is what makes it the backend of
compiled training: inductor fuses each quantization (amax, scale, cast, and the transposes
of the backward) with the elementwise work beside it, the weight is re-quantized inside
the graph where its amax reduction rides along with the optimizer's write of it, and
``mode="reduce-overhead"`` captures the whole step as a CUDA graph.

Operands per pass (row scales per row of the operand as the GEMM reads it):
fwd ``x[M,K] @ W[N,K]^T``; dgrad ``dY[M,N] @ (W^T)[K,N]^T``; wgrad ``(dY^T)[N,M] @ (x^T)[K,M]^T``.
A pass whose GEMM dims are not multiples of 16 (``_scaled_mm``'s rule; in practice a batch
of odd size in wgrad) runs in high precision for that call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loka.kernels.native import (
    NATIVE_ALIGN,
    NATIVE_BACKEND,
    NATIVE_CPU_BACKEND,
    NATIVE_FAST_BACKEND,
    native_mm,
    native_refusal,
    quantize_native,
)
from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.dtypes import cast


@dataclass(frozen=True)
class NativePass:
    a_fmt: str
    b_fmt: str
    granularity: str
    pow2: bool
    scale_ub: float | None
    fast_accum: bool = False  # torch.native.fast: the GEMM accumulates in reduced precision

    def quantize(self, t: torch.Tensor, side: str, transpose: bool = False):
        fmt = self.a_fmt if side == "a" else self.b_fmt
        return quantize_native(
            t, fmt, self.granularity, pow2=self.pow2, scale_ub=self.scale_ub,
            transpose=transpose,
        )  # fmt: skip


def _native_pass(name: str, config: PassConfig) -> NativePass | None:
    if config.is_bf16:
        return None
    r = config.recipe
    reason = native_refusal(r.a_format, r.b_format, r.granularity, r.scaling)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    fast = config.backend == NATIVE_FAST_BACKEND
    return NativePass(r.a_format, r.b_format, r.granularity, r.pow2, r.scale_ub, fast)


@dataclass(frozen=True)
class NativePlan:
    """The FP8 passes of a native linear (None: that pass in high precision). Immutable
    and hashable: torch.compile treats it as a constant."""

    fwd: NativePass | None
    dgrad: NativePass | None
    wgrad: NativePass | None
    any_shape: bool = False  # torch.native.cpu: on the CPU every shape runs in FP8

    @classmethod
    def of(cls, config: Fp8LinearConfig) -> NativePlan | None:
        """The native plan of `config`, or None when no FP8 pass names the native backend.
        A linear runs natively as a whole: mixing ``torch.native`` with another FP8 backend
        in one linear is refused (their weight copies and saved operands differ); its fast-
        accumulation variant mixes freely (the same operands, another GEMM flag)."""
        backends = {p.backend for p in config.passes().values() if not p.is_bf16}
        native = {NATIVE_BACKEND, NATIVE_FAST_BACKEND}
        name = next((n for n in (NATIVE_BACKEND, NATIVE_FAST_BACKEND, NATIVE_CPU_BACKEND)
                     if n in backends), None)  # fmt: skip
        if name is None:
            return None
        if not (backends <= native if name in native else backends == {name}):
            raise ValueError(
                f"{name} runs every FP8 pass of a linear or none; got backends "
                f"{sorted(str(b) for b in backends)}"
            )
        if config.pad:
            raise ValueError(f"{NATIVE_BACKEND} does not pad: shapes must be multiples of 16")
        return cls(
            _native_pass("fwd", config.fwd),
            _native_pass("dgrad", config.dgrad),
            _native_pass("wgrad", config.wgrad),
            any_shape=name == NATIVE_CPU_BACKEND,
        )


def _aligned(plan: NativePlan, t: torch.Tensor, *dims: int) -> bool:
    """Whether the pass runs in FP8 at these GEMM dims: multiples of 16 for _scaled_mm, any
    on the CPU for torch.native.cpu (its GEMM is emulated there)."""
    if plan.any_shape and t.device.type == "cpu":
        return True
    return all(d % NATIVE_ALIGN == 0 for d in dims)


class NativeFp8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` for a 2-D x, each pass as `plan` says; high-precision passes run in
    `compute_dtype` (the autocast dtype under autocast), as nn.Linear would."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: NativePlan,
        compute_dtype: torch.dtype,
        keep_wgrad: bool,
    ) -> torch.Tensor:
        M, K = x.shape
        N = weight.shape[0]
        fwd = plan.fwd if _aligned(plan, x, K, N) else None
        if fwd is not None:
            xq, x_inv = fwd.quantize(x, "a")
            wq, w_inv = fwd.quantize(weight, "b")
            # Every FP8 GEMM writes bf16 (rowwise _scaled_mm writes nothing else); cast after.
            y = native_mm(xq, x_inv, wq, w_inv, bias, torch.bfloat16, fast_accum=fwd.fast_accum)
            y = cast(y, compute_dtype)
        else:
            b = None if bias is None else cast(bias, compute_dtype)
            y = F.linear(cast(x, compute_dtype), cast(weight, compute_dtype), b)
        wgrad = plan.wgrad if keep_wgrad and _aligned(plan, x, M, K) else None
        if wgrad is not None:
            # x^T quantized now (one pass over x, fused with its producer) and saved in FP8.
            xt, xt_inv = wgrad.quantize(x, "b", transpose=True)
            ctx.save_for_backward(weight, xt, xt_inv)
        else:
            ctx.save_for_backward(weight, x if keep_wgrad else None)
        ctx.plan, ctx.compute_dtype, ctx.wgrad_fp8 = plan, compute_dtype, wgrad is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan, compute_dtype = ctx.plan, ctx.compute_dtype
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        saved = ctx.saved_tensors
        weight = saved[0]
        N, K = weight.shape
        dx = dw = db = None
        dgrad = plan.dgrad if _aligned(plan, dy, N, K) else None
        if need_dx and dgrad is not None:
            dyq, dy_inv = dgrad.quantize(dy, "a")
            wt, wt_inv = dgrad.quantize(weight, "b", transpose=True)
            dx = cast(native_mm(dyq, dy_inv, wt, wt_inv, fast_accum=dgrad.fast_accum), x_dtype)
        elif need_dx:
            dx = cast(cast(dy, compute_dtype) @ cast(weight, compute_dtype), x_dtype)
        if need_dw and ctx.wgrad_fp8:
            xt, xt_inv = saved[1], saved[2]
            dyt, dyt_inv = plan.wgrad.quantize(dy, "a", transpose=True)
            fast = plan.wgrad.fast_accum
            dw = cast(native_mm(dyt, dyt_inv, xt, xt_inv, fast_accum=fast), w_dtype)
        elif need_dw:
            x = saved[1]
            dw = cast(cast(dy.t(), compute_dtype) @ cast(x, compute_dtype), w_dtype)
        if need_db:
            db = cast(dy.sum(0), b_dtype)
        return dx, dw, db, None, None, None
