"""The autograd op: forward and backward of the packed multi-LoRA linear, all in the kernels.

Forward: `h = x A^T` (shrink), `y = base + s h B^T` (expand). Backward: `dh = s dy B`
(shrink), `dx = dh A` (expand), `dA = dh^T x` and `dB = s dy^T h` (wgrad).
"""

from __future__ import annotations

import torch

from loka.plora.kernels.expand import lora_expand
from loka.plora.kernels.shrink import lora_shrink
from loka.plora.kernels.wgrad import lora_wgrad


class MultiLoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base_out, a_cat, b_cat, layout):
        h = lora_shrink(x, a_cat, layout)
        y = lora_expand(h, b_cat, layout, base=base_out, scaled=True)
        ctx.save_for_backward(x, h, a_cat, b_cat)
        ctx.layout = layout
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, a_cat, b_cat = ctx.saved_tensors
        layout = ctx.layout
        dy = dy.contiguous()
        dh = lora_shrink(dy, b_cat.t(), layout, scaled=True)
        dx = lora_expand(dh, a_cat.t(), layout, scaled=False) if ctx.needs_input_grad[0] else None
        da = db = None
        if ctx.needs_input_grad[2]:
            da = lora_wgrad(dh, x, layout, rank_on_left=True, scaled=False, out_dtype=a_cat.dtype)
        if ctx.needs_input_grad[3]:
            db = lora_wgrad(dy, h, layout, rank_on_left=False, scaled=True, out_dtype=b_cat.dtype)
        return dx, dy if ctx.needs_input_grad[1] else None, da, db, None
