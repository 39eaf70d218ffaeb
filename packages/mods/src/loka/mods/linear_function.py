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
from loka.mods.eager_graphs import EagerGraphs
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


def quantize_for_passes(
    t: torch.Tensor,
    history: torch.Tensor,
    rows: int,
    cols: int,
    first: tuple[str, int, bool],
    wgrad: tuple[str, int, bool],
    share: bool,
) -> tuple[Quantized | None, Quantized | None]:
    """`t` quantized for its first pass (x: fwd, dY: dgrad) and, transposed, for wgrad, each
    given as (config, history window, needed); None for a pass not in FP8 or not needed.
    With `share` (the two recipes agree) one quantization makes both."""
    first_config, first_window, need_first = first
    wgrad_config, wgrad_window, need_wgrad = wgrad
    first_q = wgrad_q = None
    if need_first and first_config:
        first_q = quantize_operand(
            t, first_config, history, first_window, rows, cols, transpose=share and need_wgrad
        )
    if need_wgrad and wgrad_config:
        if first_q is not None and first_q.t_data is not None:
            wgrad_q = first_q
        else:
            # Quantized its own way (the first pass's quantization recorded the amax).
            wgrad_q = quantize_operand(
                t, wgrad_config, history, wgrad_window, rows, cols, transpose=True,
                push=not (first_q is not None and first_window),
            )  # fmt: skip
    return first_q, wgrad_q


def quantize_grad_output(
    dy: torch.Tensor,
    grad_history: torch.Tensor,
    plan: LinearPlan,
    rows: int,
    cols: int,
    need_dx: bool,
    need_dw: bool,
) -> tuple[Quantized | None, Quantized | None]:
    """dY quantized for dgrad and, transposed, for wgrad (`quantize_for_passes`)."""
    return quantize_for_passes(
        dy, grad_history, rows, cols, (plan.dgrad_dy, plan.dgrad_dy_window, need_dx),
        (plan.wgrad_dyt, plan.wgrad_dy_window, need_dw), plan.shares_dy,
    )  # fmt: skip


def linear_backward(
    plan: LinearPlan,
    dy: torch.Tensor,
    saved: SavedForBackward,
    shape: tuple[int, int, int],
    compute_dtype: torch.dtype,
    grad_history: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    graphs: EagerGraphs | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dgrad ``dY W`` [M, K], wgrad ``dY^T x`` [N, K]) as the plan says, uncast; None for
    what is not needed. dY is quantized once for both passes when their recipes agree; with
    `graphs`, that quantization replays a CUDA graph (`loka.mods.eager_graphs`)."""
    M, K, N = shape
    Mp, _, Np = plan.multiples.pad(M, K, N)
    dx = dw = None
    consts = (plan, Mp, Np, need_dx, need_dw)
    fp8_work = (need_dx and plan.dgrad_dy) or (need_dw and plan.wgrad_dyt)
    if graphs is not None and fp8_work and graphs.usable(dy):  # an empty graph warns
        dgrad_q, wgrad_q = graphs.run("grad", quantize_grad_output, (dy, grad_history), consts)
    else:
        dgrad_q, wgrad_q = quantize_grad_output(dy, grad_history, *consts)
    if dgrad_q is not None:
        dx = gemm(
            dgrad_q, plan.dgrad_dy, saved.wt_data, saved.wt_inv_scale, plan.dgrad_wt, None,
            plan.dgrad_backend,
        )  # fmt: skip
        dx = unpad(dx, M, K)
    elif need_dx:
        dx = high_precision_mm(dy, saved.weight, compute_dtype)
    if wgrad_q is not None:
        dw = gemm(
            wgrad_q, plan.wgrad_dyt, saved.xt_data, saved.xt_inv_scale, plan.wgrad_xt, None,
            plan.wgrad_backend, transposed=True,
        )  # fmt: skip
        dw = unpad(dw, N, K)
    elif need_dw:
        dw = high_precision_mm(dy.t(), saved.x, compute_dtype)
    return dx, dw


def quantize_input(
    x: torch.Tensor,
    input_history: torch.Tensor,
    plan: LinearPlan,
    rows: int,
    cols: int,
    keep_wgrad: bool,
) -> tuple[Quantized | None, Quantized | None]:
    """x quantized for the forward and x^T for wgrad, kept for the backward
    (`quantize_for_passes`)."""
    return quantize_for_passes(
        x, input_history, rows, cols, (plan.fwd_x, plan.fwd_x_window, True),
        (plan.wgrad_xt, plan.wgrad_x_window, keep_wgrad), plan.shares_x,
    )  # fmt: skip


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with per-pass FP8. Arguments after the plan: the compute dtype of the
    high-precision passes, whether the weight gradient will be needed (else nothing is kept
    for wgrad), the input and grad histories, the module's `EagerGraphs` (None: no CUDA
    graphs, as under torch.compile), then the cached weight's FP8 data and inverse scales,
    fwd layout then dgrad layout."""

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
        graphs: EagerGraphs | None,
        *cache: torch.Tensor,
    ) -> torch.Tensor:
        M, K = x.shape
        N = weight.shape[0]
        Mp, Kp, Np = plan.multiples.pad(M, K, N)
        consts = (plan, Mp, Kp, keep_wgrad)
        if graphs is not None and (plan.fwd_x or (keep_wgrad and plan.wgrad_xt)):
            fwd_q, wgrad_q = graphs.run("input", quantize_input, (x, input_history), consts)
        else:
            fwd_q, wgrad_q = quantize_input(x, input_history, *consts)
        if fwd_q is not None:
            b = None if bias is None else pad_vector(bias, Np)
            y = gemm(fwd_q, plan.fwd_x, cache[0], cache[1], plan.fwd_w, b, plan.fwd_backend)
            y = cast(unpad(y, M, N), compute_dtype)
        else:
            b = None if bias is None else cast(bias, compute_dtype)
            y = F.linear(cast(x, compute_dtype), cast(weight, compute_dtype), b)
        fp8_wgrad = wgrad_q is not None
        saved = SavedForBackward(
            x if keep_wgrad and not plan.wgrad_xt else None,
            wgrad_q.t_data if fp8_wgrad else None,
            wgrad_q.t_inv_scale if fp8_wgrad else None,
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
        ctx.graphs = graphs
        # Saved graph memory (x^T, the weight cache) stays valid until this backward ran.
        backward_due = any(ctx.needs_input_grad[:3])  # grad mode is off inside forward
        ctx.pending = graphs.hold() if graphs is not None and backward_due else None
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        graphs = ctx.graphs
        if graphs is not None:
            graphs.check_current(ctx.pending)
        dx, dw = linear_backward(
            ctx.plan, dy, SavedForBackward(*ctx.saved_tensors), ctx.shape, ctx.compute_dtype,
            ctx.grad_history, need_dx, need_dw, graphs,
        )  # fmt: skip
        dx = None if dx is None else cast(dx, x_dtype)
        dw = None if dw is None else cast(dw, w_dtype)
        db = cast(bias_gradient(dy, ctx.plan.bias_grad), b_dtype) if need_db else None
        return dx, dw, db, None, None, None, None, None, None, *([None] * 4)
