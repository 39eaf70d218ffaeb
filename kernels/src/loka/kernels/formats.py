"""The checks every public entry point of the kernels shares. The FP8 vocabulary itself
(formats and their maxima, granularities, block shapes, passes, `QuantConfig`) is
loka.schema's."""

from __future__ import annotations

import torch

from loka.schema import PASSES

ACTIVATIONS: tuple[str | None, ...] = (None, "relu", "gelu", "silu")
HIGH_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


def check_high_precision_2d(x: object, name: str = "x") -> torch.Tensor:
    """A 2-D bf16/fp16/fp32 tensor, or a TypeError/ValueError saying what is wrong."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    return x


def check_activation(activation: str | None) -> str | None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def check_out_dtype(out_dtype: torch.dtype) -> torch.dtype:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return out_dtype


def check_pass(pass_: str) -> str:
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    return pass_
