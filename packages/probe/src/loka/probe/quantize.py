"""FP8 quantization of one sampled GEMM operand: `loka.schema.fp8`'s reference quantization,
with the scales the full tensor would get.

An operand is given in *pass layout*: a 2-D tensor `[rows, R]` whose second dimension is
the GEMM's reduction dimension, so that a pass computes `A @ B.T` for operands `A [P, R]`
and `B [Q, R]`. Probe keeps a sample of the rows of activations and gradients, so the
amaxes that set tensorwise scales (and the rowwise scales of wgrad, whose rows reduce over
every token) come from the full tensor, measured when it was captured.
"""

from __future__ import annotations

import torch

from loka.schema import QuantConfig
from loka.schema.fp8 import expand_scale, quantize_reference, saturate_cast, scale_from_amax


def quantize_operand(
    x: torch.Tensor,
    config: QuantConfig,
    *,
    tensor_amax: torch.Tensor | None = None,
    row_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, scales broadcastable to `x`) of operand `x [rows, R]` quantized as
    `config` says. `tensor_amax` (tensorwise) and `row_amax` (rowwise) replace the amax
    measured on `x` itself: the full tensor's, or a delayed amax history's."""
    rows, cols = x.shape
    granularity = config.granularity
    amax = None
    if granularity == "tensor" and tensor_amax is not None:
        amax = tensor_amax.float().reshape(1)
    elif granularity == "row" and row_amax is not None:
        amax = row_amax.float().reshape(rows)
    if amax is None:
        q, scale, _ = quantize_reference(x, config)
    else:
        # `quantize_reference(x, config, amax)` less the amax it would measure on x and
        # return, which nothing here reads: a sampled step quantizes each operand under
        # several recipes, and on a GPU the analysis pays host time per op.
        scale = scale_from_amax(amax, config.fmt, config.pow2, config.scale_ub)
        full = expand_scale(scale, rows, cols, granularity, config.block)
        q = saturate_cast(x, full, config.fmt)
    if granularity == "tensor":
        return q, scale.view(1, 1)
    if granularity == "row":
        return q, scale.view(rows, 1)
    return q, expand_scale(scale, rows, cols, granularity, config.block)
