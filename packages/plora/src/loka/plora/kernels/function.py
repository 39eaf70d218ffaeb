"""The autograd op: forward and backward of the packed multi-LoRA linear, all in the kernels.

Two kernel paths compute the same op:
- "fused" (the default): forward `lora_forward` (down and up products in one launch, h in
  registers); backward `lora_backward_data` (`dh = s dy B` and `dx = dh A` in one launch)
  and `lora_wgrad_split` (`dA = dh^T x` and `dB = s dy^T h` for all adapters, split over
  token chunks, then reduced): 4 launches per forward + backward. Needs max rank <= 128.
- "unfused" (the first version): forward `h = x A^T` (shrink), `y = base + s h B^T`
  (expand); backward `dh = s dy B` (shrink), `dx = dh A` (expand), `dA = dh^T x` and
  `dB = s dy^T h` (wgrad, each program looping over its adapter's whole segment):
  6 launches. Any rank.
"""

from __future__ import annotations

import os

import torch

from loka.plora.kernels._launch import MAX_FUSED_RANK
from loka.plora.kernels.expand import lora_expand
from loka.plora.kernels.fused_backward import lora_backward_data
from loka.plora.kernels.fused_forward import lora_forward
from loka.plora.kernels.layout import MultiLoraLayout
from loka.plora.kernels.shrink import lora_shrink
from loka.plora.kernels.wgrad import lora_wgrad
from loka.plora.kernels.wgrad_split import lora_wgrad_split

PATHS = ("fused", "unfused")


def resolve_path(path: str | None, layout: MultiLoraLayout) -> str:
    """The kernel path: `path`, else $LOKA_PLORA_KERNELS, else "fused"; "fused" becomes
    "unfused" when an adapter's rank exceeds the fused kernels' rank tile (128)."""
    chosen = path or os.environ.get("LOKA_PLORA_KERNELS") or "fused"
    if chosen not in PATHS:
        raise ValueError(f"multi-LoRA kernel path must be one of {PATHS}, got {chosen!r}")
    if chosen == "fused" and layout.max_rank > MAX_FUSED_RANK:
        return "unfused"
    return chosen


class MultiLoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base_out, a_cat, b_cat, layout, path="unfused"):
        if path == "fused":
            y, h = lora_forward(x, a_cat, b_cat, base_out, layout)
        else:
            h = lora_shrink(x, a_cat, layout)
            y = lora_expand(h, b_cat, layout, base=base_out, scaled=True)
        ctx.save_for_backward(x, h, a_cat, b_cat)
        ctx.layout = layout
        ctx.path = path
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, a_cat, b_cat = ctx.saved_tensors
        layout = ctx.layout
        dy = dy.contiguous()
        need_dx, need_da, need_db = (ctx.needs_input_grad[i] for i in (0, 2, 3))
        dbase = dy if ctx.needs_input_grad[1] else None
        if ctx.path == "fused":
            dx, dh = lora_backward_data(dy, a_cat, b_cat, layout, need_dx=need_dx)
            da = db = None
            if need_da or need_db:
                da, db = lora_wgrad_split(
                    dh, x, h, dy, layout, out_dtype=a_cat.dtype, db_like=b_cat
                )
            return dx, dbase, da if need_da else None, db if need_db else None, None, None
        dh = lora_shrink(dy, b_cat.t(), layout, scaled=True)
        dx = lora_expand(dh, a_cat.t(), layout, scaled=False) if need_dx else None
        da = db = None
        if need_da:
            da = lora_wgrad(dh, x, layout, rank_on_left=True, scaled=False, out_dtype=a_cat.dtype)
        if need_db:
            db = lora_wgrad(dy, h, layout, rank_on_left=False, scaled=True, out_dtype=b_cat.dtype)
        return dx, dbase, da, db, None, None


class MultiLoraBaseLinearFunction(torch.autograd.Function):
    """The base linear and the adapters in one op (fused kernels only): y is the base GEMM's
    output with the adapters added in place, and the adapters' `dh A_i` is added in place to
    the base GEMM's input gradient: no [T, N] output of its own and no separate [T, K] add of
    two input gradients (autograd's, when base and adapters are two ops).

    The factors may be in another float dtype than x (PackedLoraLinear's float32 packed
    parameters): the op casts them to x's dtype itself and returns their gradients in their
    own dtype and strides, so a packed step has no cast or transpose nodes of its own."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_cat, b_cat, layout):
        a_x, b_x = a_cat.to(x.dtype), b_cat.to(x.dtype)
        base = torch.nn.functional.linear(x, weight, bias)
        y, h = lora_forward(x, a_x, b_x, base, layout, out=base)
        ctx.save_for_backward(x, weight, h, a_x, b_x)
        ctx.layout = layout
        ctx.factor_dtype = a_cat.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, h, a_cat, b_cat = ctx.saved_tensors
        layout = ctx.layout
        dy = dy.contiguous()
        need_dx, need_dw, need_db, need_da, need_dbb = ctx.needs_input_grad[:5]
        base_dx = dy @ weight if need_dx else None
        dx, dh = lora_backward_data(
            dy, a_cat, b_cat, layout, need_dx=need_dx, accumulate_into=base_dx
        )
        dw = dy.t() @ x if need_dw else None
        dbias = dy.sum(0) if need_db else None
        da = db = None
        if need_da or need_dbb:
            # dB in B's own strides: a transposed view of a packed B^T gets its gradient
            # with no transposing copy.
            da, db = lora_wgrad_split(
                dh, x, h, dy, layout, out_dtype=ctx.factor_dtype, db_like=b_cat
            )
        return dx, dw, dbias, da if need_da else None, db if need_dbb else None, None
