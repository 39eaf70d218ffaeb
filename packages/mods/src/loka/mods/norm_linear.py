"""Norm fusion: a LayerNorm/RMSNorm feeding a linear becomes one module whose forward runs
the norm and the FP8 quantization of its output in one kernel (`loka.kernels.norm_quantize`),
then the FP8 GEMM; the backward goes through `norm_backward`.

The parent module's forward still calls both (``self.fc1(self.norm(x))``), so the fusion
replaces the norm by `FusedNorm`, which passes its input through and keeps the norm's
Parameters under the same names, and the linear by `NormLinear`, which normalizes inside.
State_dict keys and Parameter objects are unchanged. This is only right when the norm's
output feeds nothing but that linear: `loka.mods.apply` finds such pairs by tracing a sample
batch and checks that the fused model gives the same outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loka.kernels.norm_quantization import MAX_ROW
from loka.mods.bias_grad import bias_gradient
from loka.mods.config import Fp8LinearConfig
from loka.mods.dtypes import cast
from loka.mods.fp8_linear import Fp8Linear, compute_dtype
from loka.mods.linear_function import (
    Quantized,
    SavedForBackward,
    gemm,
    linear_backward,
    pad_vector,
    quantize_operand,
    unpad,
)
from loka.mods.linear_plan import LinearPlan
from loka.mods.ops import call

__all__ = [
    "FusedNorm",
    "NormLinear",
]

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


class FusionError(ValueError):
    """A norm and a linear that cannot be fused (the message says why)."""


def norm_kind(norm: nn.Module) -> str:
    if isinstance(norm, nn.LayerNorm):
        return "layernorm"
    if isinstance(norm, nn.RMSNorm):
        return "rmsnorm"
    raise FusionError(f"{type(norm).__name__} is not an nn.LayerNorm or nn.RMSNorm")


class FusedNorm(nn.Module):
    """Stands where a fused norm stood: holds its Parameters (same objects, same names) and
    passes its input through; the `NormLinear` after it normalizes. `to_norm()` rebuilds the
    norm module."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.kind = norm_kind(norm)
        shape = tuple(norm.normalized_shape)
        if len(shape) != 1:
            raise FusionError(f"only norms over the last dim fuse, got normalized_shape {shape}")
        self.normalized_shape = shape
        self.eps = norm.eps
        self.weight = norm.weight
        self.register_parameter("bias", getattr(norm, "bias", None))
        self.train(norm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """What the original norm computed (torch's own functional norm)."""
        if self.kind == "layernorm":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def eps_for(self, dtype: torch.dtype) -> float:
        # nn.RMSNorm's eps=None means the input dtype's machine epsilon.
        return torch.finfo(dtype).eps if self.eps is None else float(self.eps)

    def to_norm(self) -> nn.Module:
        """An nn.LayerNorm or nn.RMSNorm holding these Parameters."""
        affine = self.weight is not None
        with torch.device("meta"):
            if self.kind == "layernorm":
                norm = nn.LayerNorm(
                    self.normalized_shape, self.eps, affine, bias=self.bias is not None
                )
            else:
                norm = nn.RMSNorm(self.normalized_shape, self.eps, affine)
        norm.weight = self.weight
        if self.kind == "layernorm":
            norm.bias = self.bias
        norm.train(self.training)
        return norm

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.normalized_shape}, eps={self.eps}, fused into the next linear"


def fusable_recipe_reason(config: Fp8LinearConfig) -> str | None:
    """Why the fwd recipe cannot run on the fused norm+quantize kernel (None if it can):
    that kernel writes one dynamic scale per row."""
    recipe = config.fwd.recipe
    if recipe.is_bf16:
        return None
    if recipe.granularity != "row" or recipe.delayed:
        return f"the fused norm kernel quantizes rowwise with dynamic scales, not {recipe}"
    return None


class NormLinear(Fp8Linear):
    """A norm (held by the `FusedNorm` that replaced it) then an `Fp8Linear`, as one module.

    With an FP8 fwd recipe the norm, the quantization of its output and the GEMM run as
    `norm_quantize` + FP8 GEMM, and the backward as the linear's dgrad/wgrad + `norm_backward`.
    With a bf16 fwd recipe it computes exactly what the norm followed by the linear did.
    """

    @classmethod
    def fuse(cls, norm: FusedNorm, linear: nn.Linear, config: Fp8LinearConfig) -> NormLinear:
        if not isinstance(norm, FusedNorm):
            raise TypeError(f"fuse takes the FusedNorm that replaced the norm, got {type(norm)}")
        if norm.normalized_shape != (linear.in_features,):
            raise FusionError(
                f"the norm normalizes {norm.normalized_shape} but the linear takes "
                f"{linear.in_features} features"
            )
        if linear.in_features > MAX_ROW:
            raise FusionError(f"rows over {MAX_ROW} features do not fit the fused kernel")
        reason = fusable_recipe_reason(config)
        if reason is not None:
            raise FusionError(reason)
        new = super().from_linear(linear, config)
        # A plain attribute, not a submodule: the norm's Parameters stay registered (once) at
        # the norm's own place in the module tree.
        object.__setattr__(new, "norm", norm)
        return new

    def _init_fp8(self, config: Fp8LinearConfig) -> None:
        reason = fusable_recipe_reason(config)
        if reason is not None:
            raise FusionError(reason)
        super()._init_fp8(config)

    def unfused(self) -> tuple[nn.Module, nn.Linear]:
        """(the norm module, an nn.Linear), both holding this module's Parameters."""
        return self.norm.to_norm(), self.to_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm: FusedNorm = self.norm
        if not self.plan.fwd_x:
            return super().forward(norm.normalize(x))
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"NormLinear: input has {x.shape[-1]} features, expected {self.in_features}"
            )
        self.refresh_weight_cache()
        x2d = x.reshape(-1, self.in_features)
        y = NormLinearFunction.apply(
            x2d, norm.weight, norm.bias, self.weight, self.bias, self.plan,
            (norm.kind, norm.eps_for(x.dtype)), compute_dtype(x),
            torch.is_grad_enabled() and self.weight.requires_grad,
            self._history("amax_history_input"), self._history("amax_history_grad_output"),
            *self.gemm_weights(),
        )  # fmt: skip
        return y.view(*x.shape[:-1], self.out_features)

    def loka_gemm_operands(self, args: tuple, output: torch.Tensor) -> list[dict]:
        """Probe's site protocol: the GEMM's input is the normalized x (recomputed here, the
        fused kernel never writes it in high precision)."""
        with torch.no_grad():
            normed = self.norm.normalize(args[0])
        return [
            {
                "input": normed,
                "weight": self.weight,
                "output": output,
                "bias": self.bias is not None,
            }
        ]

    def extra_repr(self) -> str:
        return f"{self.norm.kind} -> {super().extra_repr()}"


class NormLinearFunction(torch.autograd.Function):
    """norm_quantize -> FP8 fwd GEMM; backward: dgrad and wgrad as the plan says
    (`linear_backward`), then norm_backward from the saved mean and rstd."""

    @staticmethod
    def forward(
        ctx, x, norm_weight, norm_bias, weight, bias, plan: LinearPlan, norm: tuple[str, float],
        compute_dtype: torch.dtype, keep_wgrad: bool, input_history: torch.Tensor,
        grad_history: torch.Tensor, *cache: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        kind, eps = norm
        M, K = x.shape
        N = weight.shape[0]
        Mp, Kp, Np = plan.multiples.pad(M, K, N)
        qd, _, qi, qa, normed, mean, rstd = call(
            "norm_quantize", x, norm_weight, norm_bias, eps, kind, plan.fwd_x, keep_wgrad, Kp
        )
        b = None if bias is None else pad_vector(bias, Np)
        quantized = Quantized(qd, qi, qa, None, None)
        y = gemm(quantized, plan.fwd_x, cache[0], cache[1], plan.fwd_w, b, plan.fwd_backend)
        y = cast(unpad(y, M, N), compute_dtype)
        if keep_wgrad and plan.wgrad_xt:
            quantized = quantize_operand(
                normed, plan.wgrad_xt, input_history, plan.wgrad_x_window, Mp, Kp,
                transpose=True,
            )  # fmt: skip
        wgrad_fp8 = keep_wgrad and bool(plan.wgrad_xt)
        saved = SavedForBackward(
            normed if keep_wgrad and not plan.wgrad_xt else None,
            quantized.t_data if wgrad_fp8 else None,
            quantized.t_inv_scale if wgrad_fp8 else None,
            weight if not plan.dgrad_dy else None,
            cache[2],
            cache[3],
        )
        ctx.plan, ctx.kind, ctx.compute_dtype = plan, kind, compute_dtype
        ctx.shape = (M, K, N)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.has_norm_bias = norm_bias is not None
        ctx.grad_history = grad_history
        ctx.save_for_backward(x, norm_weight, mean if kind == "layernorm" else None, rstd, *saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, norm_weight, mean, rstd, *saved = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        need = ctx.needs_input_grad
        need_norm_input = need[0] or need[1] or need[2]
        dnormed, dw = linear_backward(
            ctx.plan, dy, SavedForBackward(*saved), ctx.shape, ctx.compute_dtype,
            ctx.grad_history, need_norm_input, need[3],
        )  # fmt: skip
        dx = dnw = dnb = None
        if need_norm_input:
            dx, dnw, dnb = call(
                "norm_backward", dnormed.contiguous(), x, norm_weight, mean, rstd, ctx.kind,
                ctx.has_norm_bias,
            )  # fmt: skip
            dnw = dnw if need[1] else None
            dnb = dnb if need[2] else None
        dw = None if dw is None else cast(dw, w_dtype)
        db = cast(bias_gradient(dy, ctx.plan.bias_grad), b_dtype) if need[4] else None
        return dx, dnw, dnb, dw, db, None, None, None, None, None, None, *([None] * 4)


def fuse_pair(
    norm: nn.Module, linear: nn.Linear, config: Fp8LinearConfig
) -> tuple[FusedNorm, NormLinear]:
    """(the module to put where the norm was, the module to put where the linear was)."""
    fused_norm = FusedNorm(norm)
    return fused_norm, NormLinear.fuse(fused_norm, linear, config)
