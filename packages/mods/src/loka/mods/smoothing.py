"""Outlier smoothing (after SmoothQuant, Xiao et al. 2023) and norm-bias folding: exact
rewrites of a norm and the linears that consume its output which make their FP8 operands
easier to quantize.

Smoothing: a channel j whose activations are much larger than the others (an outlier
channel) squeezes every other channel of a row into few FP8 codes. With per-channel factors
``s_j = amax_x[j]**alpha / amax_w[j]**(1 - alpha)`` (``amax_w[j]``: the largest ``|W[:, j]|``
over the linears), dividing the norm's output channel j by ``s_j`` and multiplying column j
of every consuming linear's weight by ``s_j`` moves difficulty from activations to weights:
``W (gamma * xhat + beta) = (W diag(s)) ((gamma * xhat + beta) / s)``, the same output in
exact arithmetic. The division is folded into the norm's weight and bias.

Norm-bias folding: ``W (gamma * xhat + beta) + b = W (gamma * xhat) + (W beta + b)``. The
norm's bias becomes zero (and frozen) and the linear's bias absorbs ``W beta``: the FP8
activation no longer carries a per-channel offset, which is added in high precision in the
GEMM's epilogue instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loka.mods.norm_linear import NORM_TYPES

__all__ = [
    "fold_norm_bias",
    "smooth",
]


class SmoothingError(ValueError):
    """A norm and linears that cannot be smoothed or folded (the message says why)."""


def _check_norm_and_linears(norm: nn.Module, linears: Sequence[nn.Linear]) -> int:
    if not isinstance(norm, NORM_TYPES):
        raise SmoothingError(f"{type(norm).__name__} is not an nn.LayerNorm or nn.RMSNorm")
    if norm.weight is None:
        raise SmoothingError("the norm has no affine weight to fold factors into")
    width = norm.weight.shape[0]
    if len(tuple(norm.normalized_shape)) != 1:
        raise SmoothingError(f"the norm normalizes {tuple(norm.normalized_shape)}, not one dim")
    if not linears:
        raise SmoothingError("no linear consumes the norm's output")
    for linear in linears:
        if not isinstance(linear, nn.Linear):
            raise SmoothingError(f"{type(linear).__name__} after the norm is not an nn.Linear")
        if linear.in_features != width:
            raise SmoothingError(
                f"a linear takes {linear.in_features} features, the norm gives {width}"
            )
    return width


def smoothing_factors(
    activation_amax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5
) -> torch.Tensor:
    """Per input channel ``amax_x**alpha / amax_w**(1 - alpha)`` (float32); 1 for a channel
    whose activation or weight amax is zero or not finite (nothing to balance)."""
    if not 0.0 <= alpha <= 1.0:
        raise SmoothingError(f"alpha must be in [0, 1], got {alpha}")
    act = activation_amax.detach().float()
    w_amax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    if act.shape != w_amax.shape:
        raise SmoothingError(
            f"activation amax has shape {tuple(act.shape)}, the weights {tuple(w_amax.shape)} "
            "input channels"
        )
    act = act.to(w_amax.device)
    factors = act.pow(alpha) / w_amax.pow(1.0 - alpha)
    usable = (act > 0) & (w_amax > 0) & factors.isfinite() & (factors > 0)
    return torch.where(usable, factors, torch.ones_like(factors))


@torch.no_grad()
def smooth(
    norm: nn.Module,
    linears: Sequence[nn.Linear],
    activation_amax: torch.Tensor,
    alpha: float = 0.5,
) -> torch.Tensor:
    """Fold smoothing factors into `norm` and the `linears` that take its output, in place;
    returns the factors. `activation_amax` is the per-channel amax of the norm's output
    (the linears' input): from Probe or `loka.mods.trace.input_channel_amax`."""
    _check_norm_and_linears(norm, linears)
    factors = smoothing_factors(activation_amax, [lin.weight for lin in linears], alpha)
    scale_channels(norm, linears, factors)
    return factors


@torch.no_grad()
def scale_channels(norm: nn.Module, linears: Sequence[nn.Linear], factors: torch.Tensor) -> None:
    """Divide the norm's output channels by `factors` and multiply the linears' input
    columns by them (exact inverse: ``scale_channels(norm, linears, 1 / factors)``)."""
    norm.weight.div_(factors.to(norm.weight.dtype))
    bias = getattr(norm, "bias", None)
    if bias is not None:
        bias.div_(factors.to(bias.dtype))
    for linear in linears:
        linear.weight.mul_(factors.to(linear.weight.dtype))


@torch.no_grad()
def fold_norm_bias(norm: nn.Module, linears: Sequence[nn.Linear]) -> torch.Tensor:
    """Move the norm's bias into the linears' biases (``b += W beta``), zero it and stop its
    gradient; returns the bias that was moved. Every linear must have a bias."""
    _check_norm_and_linears(norm, linears)
    bias = getattr(norm, "bias", None)
    if bias is None:
        raise SmoothingError("the norm has no bias to fold")
    missing = [i for i, lin in enumerate(linears) if lin.bias is None]
    if missing:
        raise SmoothingError("the linear after the norm has no bias to fold the norm's bias into")
    moved = bias.detach().clone()
    for linear in linears:
        linear.bias.add_((linear.weight.double() @ moved.double()).to(linear.bias.dtype))
    bias.zero_()
    bias.requires_grad_(False)
    return moved
