"""Pure-torch references of what an `Fp8Linear` computes: every pass quantized with
`loka.kernels.quantization.quantize_reference` and multiplied in float64 (`mm_reference`), in the
operand layouts of the kernels (see `loka.mods.linear_plan`). The modules are tested
against these; they also show, in a few lines, what each recipe does to a linear.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loka.kernels.fp8_gemm import mm_reference
from loka.kernels.quantization import quantize_reference
from loka.mods.config import Fp8LinearConfig, PassConfig

__all__ = [
    "fp8_linear_reference",
]


class LinearPasses(NamedTuple):
    y: torch.Tensor  # [M, N]
    dx: torch.Tensor | None  # [M, K]
    dw: torch.Tensor | None  # [N, K]


def _pass(
    a: torch.Tensor,
    b: torch.Tensor,
    config: PassConfig,
    b_is_weight: bool,
    amax: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor:
    """``a @ b.T`` in float32, quantized as `config` says (or exactly, for bf16 passes); a
    ``center`` recipe quantizes ``a`` less its column means over the tokens (its rows) and
    adds their exact product with ``b``."""
    if config.is_bf16:
        return (a.double() @ b.double().T).float()
    shared = None
    if config.recipe.center:
        mean = a.float().mean(dim=0, keepdim=True)
        a, shared = a.float() - mean, (mean.double() @ b.double().T).float()
    qa = quantize_reference(a, config.recipe.operand("a", False), amax[0])
    qb = quantize_reference(b, config.recipe.operand("b", b_is_weight), amax[1])
    out = mm_reference(qa, qb, out_dtype=torch.float32)
    return out if shared is None else out + shared


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: Fp8LinearConfig,
    grad_output: torch.Tensor | None = None,
    *,
    input_amax: torch.Tensor | None = None,
    weight_amax: torch.Tensor | None = None,
    grad_amax: torch.Tensor | None = None,
) -> LinearPasses:
    """fwd ``x W^T`` (no bias), and with `grad_output`: dgrad ``dY W`` and wgrad ``dY^T x``,
    each as `config` quantizes it. `*_amax` (shaped like the operand's scales) replace the
    measured amax of that role: delayed scaling's history maximum."""
    y = _pass(x, weight, config.fwd, True, (input_amax, weight_amax))
    if grad_output is None:
        return LinearPasses(y, None, None)
    dx = _pass(grad_output, weight.t().contiguous(), config.dgrad, True, (grad_amax, weight_amax))
    dw = _pass(
        grad_output.t().contiguous(), x.t().contiguous(), config.wgrad, False,
        (grad_amax, input_amax),
    )  # fmt: skip
    return LinearPasses(y, dx, dw)
