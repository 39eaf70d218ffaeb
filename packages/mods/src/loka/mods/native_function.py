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
``_scaled_mm`` needs a GEMM's contracted dim and its output's columns in multiples of 16: K
and N (every pass) and M (wgrad contracts the tokens). Where they are not, the operands are
zero-padded up to them before quantizing and the result is sliced back: exact (a zero row
or column adds nothing to any product and changes no amax; an all-zero row gets scale 1),
and under torch.compile the pad is part of the quantization's fused kernel. So every shape
runs in FP8: InterFormer xl's 7507-wide `fc1` (refused before) and the jagged batches whose
token count M is rarely a multiple of 16 (their wgrad ran in high precision, and a compiled
graph guarded on M's alignment). A symbolic M (a dynamic-shape graph) is always padded, by
`(-M) % 16` rows, so the graph does not guard on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from loka.kernels.native import (
    NATIVE_ALIGN,
    NATIVE_BACKEND,
    NATIVE_CPU_BACKEND,
    NATIVE_FAST_BACKEND,
    native_mm,
    native_refusal,
    quantize_native,
    saturate_cast_native,
)
from loka.mods.bias_grad import bias_gradient
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
    tokens_vary: bool = False  # Fp8LinearConfig.tokens_vary: M may be symbolic when compiled
    center: bool = False  # the recipe's `center`: the first operand's token mean taken out

    def centered(
        self, t: torch.Tensor, other: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`t` [M, C] as the pass quantizes it, the product of its token mean with `other`
        [C, width] padded to `width`: the term the GEMM's epilogue adds back as a bias), or
        (`t`, None) for a pass that does not center. The mean is float32 and the product
        (a GEMV) is taken with the high-precision `other`, so what every token shares is
        exact up to the output's own rounding and FP8 rounds only what varies."""
        if not self.center:
            return t, None
        t = t.float()
        mean = t.mean(dim=0, keepdim=True)
        shared = (mean @ other.float()).squeeze(0)
        pad = width - shared.shape[0]
        return t - mean, shared if statically_known_true(pad == 0) else F.pad(shared, (0, pad))

    def quantize(self, t: torch.Tensor, side: str, transpose: bool = False, tokens: bool = True):
        """`t` quantized as operand `side` of this pass; `tokens`: its rows are the batch's
        tokens (an activation or gradient, not the weight)."""
        fmt = self.a_fmt if side == "a" else self.b_fmt
        return quantize_native(
            t, fmt, self.granularity, pow2=self.pow2, scale_ub=self.scale_ub,
            transpose=transpose, rows_vary=tokens and self.tokens_vary,
        )  # fmt: skip


def _native_pass(name: str, linear: Fp8LinearConfig) -> NativePass | None:
    config: PassConfig = getattr(linear, name)
    if config.is_bf16:
        return None
    r = config.recipe
    reason = native_refusal(r.a_format, r.b_format, r.granularity, r.scaling)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    fast = config.backend == NATIVE_FAST_BACKEND
    return NativePass(r.a_format, r.b_format, r.granularity, r.pow2, r.scale_ub, fast,
                      linear.tokens_vary, r.center)  # fmt: skip


@dataclass(frozen=True)
class NativePlan:
    """The FP8 passes of a native linear (None: that pass in high precision). Immutable
    and hashable: torch.compile treats it as a constant."""

    fwd: NativePass | None
    dgrad: NativePass | None
    wgrad: NativePass | None
    any_shape: bool = False  # torch.native.cpu (every native linear pads: any shape runs)
    bias_grad: str = "sum"  # `loka.mods.bias_grad`

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
            _native_pass("fwd", config),
            _native_pass("dgrad", config),
            _native_pass("wgrad", config),
            any_shape=name == NATIVE_CPU_BACKEND,
            bias_grad=config.bias_grad,
        )


def _up(d):
    """`d` rounded up to a multiple of NATIVE_ALIGN (an int or a symbolic size)."""
    return (d + NATIVE_ALIGN - 1) // NATIVE_ALIGN * NATIVE_ALIGN


def _pad_to(t: torch.Tensor, rows, cols) -> torch.Tensor:
    """`t` ``[R, C]`` zero-padded to ``[rows, cols]``; `t` itself when no padding is needed
    and that is known without a guard (static sizes)."""
    r, c = t.shape
    pad_r, pad_c = rows - r, cols - c
    if statically_known_true(pad_r == 0) and statically_known_true(pad_c == 0):
        return t
    return F.pad(t, (0, pad_c, 0, pad_r))


def _cols(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` columns of a padded GEMM output."""
    return t if t.shape[1] == n else t[:, :n]


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
        Kp = _up(K)
        fwd = plan.fwd
        if fwd is not None:
            wq, w_inv = quantize_weight(weight, fwd)
            y = quantized_weight_forward(x, wq, w_inv, bias, fwd, compute_dtype, N, weight=weight)
        else:
            b = None if bias is None else cast(bias, compute_dtype)
            y = F.linear(cast(x, compute_dtype), cast(weight, compute_dtype), b)
        wgrad = plan.wgrad if keep_wgrad else None
        if wgrad is not None:
            # x^T quantized now (one pass over x, fused with its producer) and saved in FP8,
            # padded to [Kp, Mp] (wgrad contracts the tokens).
            xt, xt_inv = wgrad.quantize(_pad_to(x, _up(M), Kp), "b", transpose=True)
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
        M = dy.shape[0]
        Kp, Np = _up(K), _up(N)
        dx = dw = db = None
        dgrad = plan.dgrad
        if need_dx and dgrad is not None:
            dy_q, shared = dgrad.centered(dy, weight, Kp)
            dyq, dy_inv = dgrad.quantize(_pad_to(dy_q, M, Np), "a")
            wt, wt_inv = dgrad.quantize(_pad_to(weight, Np, Kp), "b", transpose=True, tokens=False)
            shared = None if shared is None else shared.to(torch.bfloat16)
            dx = native_mm(dyq, dy_inv, wt, wt_inv, shared, fast_accum=dgrad.fast_accum)
            dx = cast(_cols(dx, K), x_dtype)
        elif need_dx:
            dx = cast(cast(dy, compute_dtype) @ cast(weight, compute_dtype), x_dtype)
        if need_dw and ctx.wgrad_fp8:
            xt, xt_inv = saved[1], saved[2]
            dyt, dyt_inv = plan.wgrad.quantize(_pad_to(dy, _up(M), N), "a", transpose=True)
            fast = plan.wgrad.fast_accum
            dw = cast(_cols(native_mm(dyt, dyt_inv, xt, xt_inv, fast_accum=fast), K), w_dtype)
        elif need_dw:
            x = saved[1]
            dw = cast(cast(dy.t(), compute_dtype) @ cast(x, compute_dtype), w_dtype)
        if need_db:
            db = cast(bias_gradient(dy, plan.bias_grad), b_dtype)
        return dx, dw, db, None, None, None


def quantized_weight_forward(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_inv_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fwd: NativePass,
    compute_dtype: torch.dtype,
    out_features: int,
    input_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 forward GEMM of a native linear given its quantized weight (`quantize_weight`:
    ``[Np, Kp]``, padded), quantized in this call or once for serving
    (`Fp8Linear.prequantize_weight`): x is quantized, multiplied, and the output cast.
    `input_scale`: (scale, inverse) of a static input scale (`Fp8Linear.set_static_input_amax`):
    x is then scaled and cast without an amax; a row recipe repeats it for every row.
    `weight`: the high-precision weight, which a centering forward (`NativePass.centered`)
    multiplies x's token mean with."""
    M = x.shape[0]
    Np, Kp = weight_fp8.shape
    shared = None
    if input_scale is None:
        if fwd.center and weight is None:
            raise ValueError("a centering forward needs the high-precision weight")
        x, shared = fwd.centered(x, None if weight is None else weight.t(), Np)
        xq, x_inv = fwd.quantize(_pad_to(x, M, Kp), "a")
    else:
        scale, inv = input_scale
        xq = saturate_cast_native(_pad_to(x, M, Kp), scale, fwd.a_fmt)
        x_inv = inv.reshape(1, 1).expand(M, 1).contiguous() if fwd.granularity == "row" else inv
    b = bias if bias is None or Np == out_features else F.pad(bias, (0, Np - out_features))
    if shared is not None:
        # bf16, so that _scaled_mm adds it in its epilogue (rounded once, like a bias): what
        # every token shares loses only the output's rounding
        b = (shared if b is None else shared + b.float()).to(torch.bfloat16)
    # Every FP8 GEMM writes bf16 (rowwise _scaled_mm writes nothing else); cast after.
    y = native_mm(xq, x_inv, weight_fp8, weight_inv_scale, b, torch.bfloat16,
                  fast_accum=fwd.fast_accum)  # fmt: skip
    return cast(_cols(y, out_features), compute_dtype)


def quantize_weight(weight: torch.Tensor, fwd: NativePass) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` ``[N, K]`` quantized as the native forward multiplies it (padded to multiples
    of 16): (FP8 data ``[Np, Kp]``, inverse scales). Detached: no autograd graph."""
    N, K = weight.shape
    return fwd.quantize(_pad_to(weight.detach(), _up(N), _up(K)), "b", tokens=False)
