"""The autograd function of `Fp8Linear`: fwd, dgrad and wgrad each in FP8 (through
`loka.mods.ops`) or in high precision, as the `LinearPlan` says.

Inputs are 2-D (the module flattens leading dims). The weight's FP8 copies come in from the
module's cache (made once per optimizer step); the forward saves what the backward needs in
the cheapest form: x^T already quantized when wgrad is FP8, else x itself. `linear_backward`
(dgrad and wgrad) is shared with `NormLinear`, whose input is the normalized x.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from loka.mods.bias_grad import bias_gradient
from loka.mods.dtypes import cast
from loka.mods.linear_plan import LinearPlan
from loka.mods.ops import call

GEMM_OUT_DTYPE = torch.bfloat16  # every FP8 backend writes bf16; results are cast after


def history_amax(history: torch.Tensor, window: int, t: torch.Tensor) -> torch.Tensor | None:
    """The amax that sets a delayed scale: the largest of the last `window` recorded amaxes,
    or `t`'s own amax (as dynamic scaling) while none is recorded yet; None for a dynamic
    recipe. Chosen on the device: no host sync, and no per-step Python flag for
    torch.compile to guard on (a flag flipping after step 1 made every model recompile)."""
    if not window:
        return None
    recorded = history[:window].amax().reshape(1).float()
    return torch.where(recorded > 0, recorded, finite_amax(t))


def finite_amax(t: torch.Tensor) -> torch.Tensor:
    """The largest finite |t| as float32 ``[1]`` (0 for an empty t): what the quantization
    kernels measure. Taken in t's dtype (exact for a maximum) to keep eager mode from making
    float32 copies of the activation."""
    if t.numel() == 0:
        return t.new_zeros(1, dtype=torch.float32)
    return t.detach().abs().nan_to_num_(nan=0.0, posinf=0.0).amax().reshape(1).float()


def push_amax(history: torch.Tensor, window: int, measured: torch.Tensor) -> None:
    """Record the amax measured this call at the front of the history (delayed scaling)."""
    if window:
        newest = measured.amax().reshape(1).to(history.dtype)
        history.copy_(torch.cat([newest, history[:-1]]))


def pad_vector(v: torch.Tensor, length: int) -> torch.Tensor:
    return v if v.shape[0] == length else F.pad(v, (0, length - v.shape[0]))


def high_precision_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cast(a, dtype) @ cast(b, dtype)


class Quantized(NamedTuple):
    data: torch.Tensor | None
    inv_scale: torch.Tensor | None
    amax: torch.Tensor
    t_data: torch.Tensor | None  # the transpose, when asked for
    t_inv_scale: torch.Tensor | None


def quantize_operand(
    t: torch.Tensor,
    config: str,
    history: torch.Tensor,
    window: int,
    rows: int,
    cols: int,
    *,
    transpose: bool,
    push: bool = True,
) -> Quantized:
    """`t` quantized (padded to [rows, cols]) and, with `transpose`, its transpose; under
    delayed scaling (`window` > 0) the scale comes from the history and, with `push`, the
    measured amax is recorded in it (once per role and call: `push` is False for the second
    quantization of an operand that another pass already recorded)."""
    amax = history_amax(history, window, t)
    if transpose:
        d, _, i, a, td, _, ti, _ = call("quantize_transpose", t, config, amax, rows, cols)
        made = Quantized(d, i, a, td, ti)
    else:
        d, _, i, a = call("quantize", t, config, amax, rows, cols)
        made = Quantized(d, i, a, None, None)
    if push:
        push_amax(history, window, made.amax)
    return made


def gemm(a: Quantized, a_config: str, b_data, b_inv, b_config, bias, backend, transposed=False):
    """The FP8 GEMM of a pass: `a` (its transpose with `transposed`) times b^T."""
    data, inv = (a.t_data, a.t_inv_scale) if transposed else (a.data, a.inv_scale)
    return call("mm", data, inv, a_config, b_data, b_inv, b_config, bias, backend, GEMM_OUT_DTYPE)


def unpad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``[rows, cols]`` corner of a padded GEMM output (t itself when not padded)."""
    return t if t.shape == (rows, cols) else t[:rows, :cols]


class SavedForBackward(NamedTuple):
    x: torch.Tensor | None  # the GEMM input in high precision (wgrad in high precision)
    xt_data: torch.Tensor | None  # x^T quantized (wgrad in FP8)
    xt_inv_scale: torch.Tensor | None
    weight: torch.Tensor | None  # W (dgrad in high precision)
    wt_data: torch.Tensor  # cached W^T quantized (dgrad in FP8)
    wt_inv_scale: torch.Tensor


def linear_backward(
    plan: LinearPlan,
    dy: torch.Tensor,
    saved: SavedForBackward,
    shape: tuple[int, int, int],
    compute_dtype: torch.dtype,
    grad_history: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dgrad ``dY W`` [M, K], wgrad ``dY^T x`` [N, K]) as the plan says, uncast; None for
    what is not needed. dY is quantized once for both passes when their recipes agree."""
    M, K, N = shape
    Mp, _, Np = plan.multiples.pad(M, K, N)
    dx = dw = None
    quantized = None
    if need_dx and plan.dgrad_dy:
        quantized = quantize_operand(
            dy, plan.dgrad_dy, grad_history, plan.dgrad_dy_window, Mp, Np,
            transpose=plan.shares_dy and need_dw,
        )  # fmt: skip
        dx = gemm(
            quantized, plan.dgrad_dy, saved.wt_data, saved.wt_inv_scale, plan.dgrad_wt, None,
            plan.dgrad_backend,
        )  # fmt: skip
        dx = unpad(dx, M, K)
    elif need_dx:
        dx = high_precision_mm(dy, saved.weight, compute_dtype)
    if need_dw and plan.wgrad_dyt:
        if quantized is None or quantized.t_data is None:
            recorded = need_dx and bool(plan.dgrad_dy) and bool(plan.dgrad_dy_window)
            quantized = quantize_operand(
                dy, plan.wgrad_dyt, grad_history, plan.wgrad_dy_window, Mp, Np,
                transpose=True, push=not recorded,
            )  # fmt: skip
        dw = gemm(
            quantized, plan.wgrad_dyt, saved.xt_data, saved.xt_inv_scale, plan.wgrad_xt, None,
            plan.wgrad_backend, transposed=True,
        )  # fmt: skip
        dw = unpad(dw, N, K)
    elif need_dw:
        dw = high_precision_mm(dy.t(), saved.x, compute_dtype)
    return dx, dw


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with per-pass FP8. Arguments after the plan: the compute dtype of the
    high-precision passes, whether the weight gradient will be needed (else nothing is kept
    for wgrad), the input and grad histories,
    then the cached weight's FP8 data and inverse scales, fwd layout then dgrad layout."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: LinearPlan,
        compute_dtype: torch.dtype,
        keep_wgrad: bool,
        input_history: torch.Tensor,
        grad_history: torch.Tensor,
        *cache: torch.Tensor,
    ) -> torch.Tensor:
        M, K = x.shape
        N = weight.shape[0]
        Mp, Kp, Np = plan.multiples.pad(M, K, N)
        quantized = None
        if plan.fwd_x:
            quantized = quantize_operand(
                x, plan.fwd_x, input_history, plan.fwd_x_window, Mp, Kp,
                transpose=plan.shares_x and keep_wgrad,
            )  # fmt: skip
            b = None if bias is None else pad_vector(bias, Np)
            y = gemm(quantized, plan.fwd_x, cache[0], cache[1], plan.fwd_w, b, plan.fwd_backend)
            y = cast(unpad(y, M, N), compute_dtype)
        else:
            b = None if bias is None else cast(bias, compute_dtype)
            y = F.linear(cast(x, compute_dtype), cast(weight, compute_dtype), b)
        if keep_wgrad and plan.wgrad_xt and (quantized is None or quantized.t_data is None):
            # x^T for wgrad, quantized its own way (the fwd quantization recorded the amax).
            recorded = bool(plan.fwd_x) and bool(plan.fwd_x_window)
            quantized = quantize_operand(
                x, plan.wgrad_xt, input_history, plan.wgrad_x_window, Mp, Kp,
                transpose=True, push=not recorded,
            )  # fmt: skip
        saved = SavedForBackward(
            x if keep_wgrad and not plan.wgrad_xt else None,
            quantized.t_data if keep_wgrad and plan.wgrad_xt else None,
            quantized.t_inv_scale if keep_wgrad and plan.wgrad_xt else None,
            weight if not plan.dgrad_dy else None,
            cache[2],
            cache[3],
        )
        ctx.plan, ctx.compute_dtype = plan, compute_dtype
        ctx.shape = (M, K, N)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # The history is mutated by every backward: held outside save_for_backward, whose
        # version check would refuse a module called twice before its backwards run.
        ctx.grad_history = grad_history
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw = linear_backward(
            ctx.plan, dy, SavedForBackward(*ctx.saved_tensors), ctx.shape, ctx.compute_dtype,
            ctx.grad_history, need_dx, need_dw,
        )  # fmt: skip
        dx = None if dx is None else cast(dx, x_dtype)
        dw = None if dw is None else cast(dw, w_dtype)
        db = cast(bias_gradient(dy, ctx.plan.bias_grad), b_dtype) if need_db else None
        return dx, dw, db, None, None, None, None, None, *([None] * 4)
