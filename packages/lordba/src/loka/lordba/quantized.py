"""Quantized frozen bases: the paper's setting is an unmerged adapter over a weight-only
quantized base, int8 or FP8.

Two kinds of base are supported by :class:`~loka.lordba.LoRDBALinear`:

- an ``nn.Linear`` whose weight a library replaced by a tensor subclass (torchao's
  ``quantize_(model, Int8WeightOnlyConfig())`` or ``Float8WeightOnlyConfig()``): the module is
  still an ``nn.Linear`` but its weight supports only the ops its library implements, so the
  adapter runs the base through its own forward (see :func:`plain_weight`);
- :class:`Fp8WeightOnlyLinear`, LoKA's own FP8 weight-only linear: the weight stored in FP8
  with one scale per output channel (``loka.schema.fp8.quantize_reference``, granularity
  ``row``), dequantized to the input's dtype at each call. It needs no GPU and no Triton, so
  the same adapter trains on a CPU over the same bytes a GPU kernel would read.

``loka.mods.Fp8Linear`` (FP8 GEMMs with activations quantized too) is accepted as a base as
well; it is a subclass of ``nn.Linear`` and always runs through its own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loka.schema import QuantConfig
from loka.schema.fp8 import fp8_dtype, quantize_reference

_PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def plain_weight(module: nn.Module) -> torch.Tensor | None:
    """The weight of ``module`` if it is an ordinary float tensor that ``torch.addmm`` can read
    (``nn.Linear``'s own), else None (a tensor subclass such as torchao's quantized weights, an
    FP8 dtype, or no weight at all)."""
    weight = getattr(module, "weight", None)
    if type(weight) not in (torch.Tensor, nn.Parameter):
        return None
    return weight if weight.dtype in _PLAIN_DTYPES else None


class GemmOperands(NamedTuple):
    """What LoKA's own GEMM (``loka.lordba.kernels.linear_sign_up``) reads of a base:
    ``weight`` ``[N, K]`` (a float weight, or FP8 codes as uint8 with ``weight_scale`` ``[N]``
    float32, ``dequant = code / scale``, in ``fp8_format``) and ``bias`` (or None)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    fp8_format: str
    bias: torch.Tensor | None


def gemm_operands(base: nn.Module, dtype: torch.dtype) -> GemmOperands | None:
    """The operands of ``base``'s GEMM for inputs of ``dtype``, read as they are stored (no
    copy of the weight), or None where LoKA's GEMM does not cover the base: a plain
    ``nn.Linear`` with a weight of ``dtype``, and an :class:`Fp8WeightOnlyLinear` (any float
    ``dtype``; its bias is cast to ``dtype`` as its forward does)."""
    if type(base) is nn.Linear:
        weight = plain_weight(base)
        if weight is None or weight.dtype != dtype:
            return None
        bias = base.bias
        return GemmOperands(weight.detach(), None, "e4m3", None if bias is None else bias.detach())
    if type(base) is Fp8WeightOnlyLinear and dtype in _PLAIN_DTYPES:
        bias = None if base.bias is None else base.bias.to(dtype)
        return GemmOperands(base.weight_fp8, base.weight_scale.reshape(-1), base.config.fmt, bias)
    return None


class Fp8WeightOnlyLinear(nn.Module):
    """``y = x dequant(W_fp8)^T + b``: a frozen linear whose weight is kept in FP8 with a
    float32 scale per output channel (``dequant = q / scale``, the LoKA convention). Weight,
    scale and bias are buffers: the module has no parameters, it is a base, never trained."""

    def __init__(self, in_features: int, out_features: int, fmt: str = "e4m3") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.config = QuantConfig(fmt=fmt, granularity="row")
        # FP8 codes kept as uint8: ``module.to(dtype)`` casts floating buffers, and FP8 ones
        # are floating; the codes must survive it unchanged.
        self.register_buffer(
            "weight_fp8", torch.zeros(out_features, in_features, dtype=torch.uint8)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, 1))
        self.register_buffer("bias", None)
        self.weight_dtype = torch.float32  # the dtype of the weight it replaced

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, fmt: str = "e4m3") -> Fp8WeightOnlyLinear:
        """Quantize ``linear``'s weight (per output channel, dynamic amax); the bias is kept
        in its dtype."""
        weight = plain_weight(linear)
        if weight is None:
            raise TypeError(
                f"Fp8WeightOnlyLinear.from_linear needs a linear with a plain float weight, got "
                f"{type(linear).__name__} with weight {type(getattr(linear, 'weight', None)).__name__}"
            )
        new = cls(linear.in_features, linear.out_features, fmt)
        quantized = quantize_reference(weight.detach().float(), new.config)
        new.weight_fp8 = quantized.data.view(torch.uint8)
        new.weight_scale = quantized.scale.reshape(-1, 1).float()
        if linear.bias is not None:
            new.bias = linear.bias.detach().clone()
        new.weight_dtype = weight.dtype
        return new.to(weight.device)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the forward multiplies, ``[out, in]`` in ``dtype`` (default: the
        original weight's)."""
        # fp8_dtype, not config.dtype: a cached property takes a lock torch.compile cannot trace.
        weight = (
            self.weight_fp8.view(fp8_dtype(self.config.fmt)).float() / self.weight_scale.float()
        )
        return weight.to(dtype or self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fmt={self.config.fmt}, bias={self.bias is not None}"
        )


def dequantized_weight(base: nn.Module) -> torch.Tensor:
    """The float weight ``[out, in]`` a base multiplies: a plain weight as it is, torchao's
    quantized tensors through their ``dequantize()``, an :class:`Fp8WeightOnlyLinear`'s FP8
    bytes over their scales. For comparing an adapter over a quantized base with the same
    adapter over its dequantized copy (:func:`dequantized_linear`)."""
    if isinstance(base, Fp8WeightOnlyLinear):
        return base.dequantize()
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(base).__name__} has no weight to dequantize")
    if plain_weight(base) is not None:
        return weight.detach()
    dequantize = getattr(weight, "dequantize", None)
    if not callable(dequantize):
        raise TypeError(
            f"the weight of {type(base).__name__} is a {type(weight).__name__} without dequantize()"
        )
    return dequantize().detach()


def dequantized_linear(base: nn.Module) -> nn.Linear:
    """A frozen ``nn.Linear`` holding the dequantized weight (and bias) of ``base``."""
    weight = dequantized_weight(base)
    bias = getattr(base, "bias", None)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias is not None, device=weight.device)
    with torch.no_grad():
        linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().clone().to(weight.dtype), requires_grad=False)
    return linear.requires_grad_(False)


def quantize_fp8_weights(
    model: nn.Module,
    fmt: str = "e4m3",
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` with a plain weight (that ``module_filter_fn(module, fqn)``
    accepts) by an :class:`Fp8WeightOnlyLinear`, in place; returns the model (a new root only
    when the model itself is a linear)."""
    from loka.lordba.convert import replace_modules

    chosen = {
        name: Fp8WeightOnlyLinear.from_linear(module, fmt)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and plain_weight(module) is not None
        and (module_filter_fn is None or module_filter_fn(module, name))
    }
    if not chosen:
        raise ValueError("quantize_fp8_weights: no nn.Linear with a plain weight matched")
    return replace_modules(model, chosen)
