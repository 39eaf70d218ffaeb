"""`LinearPlan`: what each pass of an FP8 linear quantizes, how, and on which backend.

Operands per pass (see `loka.kernels.registry.gemm_dims`): fwd ``x[M,K] @ W[N,K]^T``, dgrad
``dY[M,N] @ (W^T)[K,N]^T``, wgrad ``(dY^T)[N,M] @ (x^T)[K,M]^T``. The plan turns a
`Fp8LinearConfig` into one quantization config per operand role and pass (as
`loka.schema.QuantConfig` strings, what the custom ops take; "" where the pass stays in
high precision), decides which quantizations can be
shared (x for fwd and wgrad from one `quantize_transpose`, likewise dY for dgrad and wgrad)
and how long each role's amax history is. It is immutable and hashable: torch.compile
treats it as a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

from loka.mods.alignment import Multiples, required_multiples
from loka.mods.config import Fp8LinearConfig, PassConfig


def _encoded(pass_config: PassConfig, side: str, is_weight: bool) -> str:
    if pass_config.is_bf16:
        return ""
    return str(pass_config.recipe.operand(side, is_weight))


def _window(pass_config: PassConfig) -> int:
    return pass_config.recipe.history if pass_config.recipe.delayed else 0


@dataclass(frozen=True)
class LinearPlan:
    fwd_x: str  # x in fwd
    fwd_w: str  # W in fwd (cached per optimizer step)
    dgrad_dy: str  # dY in dgrad
    dgrad_wt: str  # W^T in dgrad (cached per optimizer step)
    wgrad_dyt: str  # dY^T in wgrad
    wgrad_xt: str  # x^T in wgrad (made in the forward, saved for the backward)
    fwd_backend: str  # "" lets loka.kernels pick
    dgrad_backend: str
    wgrad_backend: str
    multiples: Multiples
    # Amax-history windows (delayed scaling; 0: dynamic) per pass and operand.
    fwd_x_window: int
    wgrad_x_window: int
    dgrad_dy_window: int
    wgrad_dy_window: int
    fwd_w_window: int
    dgrad_wt_window: int
    bias_grad: str = "sum"  # `loka.mods.bias_grad`

    @classmethod
    def of(cls, config: Fp8LinearConfig) -> LinearPlan:
        fwd, dgrad, wgrad = config.fwd, config.dgrad, config.wgrad
        return cls(
            fwd_x=_encoded(fwd, "a", False),
            fwd_w=_encoded(fwd, "b", True),
            dgrad_dy=_encoded(dgrad, "a", False),
            dgrad_wt=_encoded(dgrad, "b", True),
            wgrad_dyt=_encoded(wgrad, "a", False),
            wgrad_xt=_encoded(wgrad, "b", False),
            fwd_backend=fwd.backend or "",
            dgrad_backend=dgrad.backend or "",
            wgrad_backend=wgrad.backend or "",
            multiples=required_multiples(config),
            fwd_x_window=_window(fwd),
            wgrad_x_window=_window(wgrad),
            dgrad_dy_window=_window(dgrad),
            wgrad_dy_window=_window(wgrad),
            fwd_w_window=_window(fwd),
            dgrad_wt_window=_window(dgrad),
            bias_grad=config.bias_grad,
        )

    @property
    def all_high_precision(self) -> bool:
        return not (self.fwd_x or self.dgrad_dy or self.wgrad_dyt)

    @property
    def shares_x(self) -> bool:
        """fwd and wgrad quantize x alike: one quantize_transpose gives x and x^T."""
        return bool(self.fwd_x) and (self.fwd_x, self.fwd_x_window) == (
            self.wgrad_xt, self.wgrad_x_window,
        )  # fmt: skip

    @property
    def shares_dy(self) -> bool:
        return bool(self.dgrad_dy) and (self.dgrad_dy, self.dgrad_dy_window) == (
            self.wgrad_dyt, self.wgrad_dy_window,
        )  # fmt: skip

    @property
    def weight_layouts(self) -> tuple[str, str, bool, bool]:
        """(fwd config, dgrad config, fwd delayed, dgrad delayed) of the cached weight; ""
        for a layout not needed."""
        return self.fwd_w, self.dgrad_wt, bool(self.fwd_w_window), bool(self.dgrad_wt_window)

    @property
    def weight_window(self) -> int:
        return max(self.fwd_w_window, self.dgrad_wt_window)

    @property
    def input_window(self) -> int:
        return max(self.fwd_x_window, self.wgrad_x_window)

    @property
    def grad_window(self) -> int:
        return max(self.dgrad_dy_window, self.wgrad_dy_window)
