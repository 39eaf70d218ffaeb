"""GEMM epilogues: bias and activation, in torch and as a Triton helper with the same math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loka.kernels.formats import check_activation

ACTIVATION_IDS = {None: 0, "relu": 1, "gelu": 2, "silu": 3}


def apply_epilogue(
    y: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """``activation(y + bias)`` in y's dtype; GELU is the exact (erf) one, as F.gelu's default."""
    check_activation(activation)
    if bias is not None:
        y = y + bias.to(y.dtype)
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "silu":
        return F.silu(y)
    return y


def check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor of shape [{n}], got {bias!r:.80}")
    if bias.shape != (n,) or bias.device != device:
        raise ValueError(
            f"bias must have shape [{n}] on {device}, got {tuple(bias.shape)} on {bias.device}"
        )
    if bias.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError("bias must be bf16, fp16 or fp32, not FP8")
    return bias.contiguous()


@triton.jit
def activation_tl(x, ACTIVATION: tl.constexpr):
    """x is float32; ids as in ACTIVATION_IDS."""
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 3:
        x = x * tl.sigmoid(x)
    return x
