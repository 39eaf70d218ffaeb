"""`fp8_mm`: one NT GEMM ``out = activation(a @ b.T + bias)`` through a registered backend."""

from __future__ import annotations

import torch

from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.registry import Backend, GemmSpec, UnsupportedError, registry


def _check_operands(a: object, b: object) -> None:
    kinds = {type(t) for t in (a, b)}
    if not (kinds <= {Fp8Tensor} or all(isinstance(t, torch.Tensor) for t in (a, b))):
        raise TypeError(
            "a and b must both be Fp8Tensor (FP8 backends) or both torch.Tensor (bf16 "
            f"backends), got {type(a).__name__} and {type(b).__name__}"
        )
    for name, t in (("a", a), ("b", b)):
        if len(t.shape) != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a is [M, K] = {tuple(a.shape)} and b is [N, K] = {tuple(b.shape)}: K differs"
        )


def fp8_mm(
    a: Fp8Tensor | torch.Tensor,
    b: Fp8Tensor | torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """``activation(a @ b.T + bias)`` for ``a[M, K]``, ``b[N, K]``, in `out_dtype`.

    `backend` names a registered backend of op "mm"; None takes the highest-priority one that
    supports these operands on their device. A backend that cannot run them raises
    `UnsupportedError` with its reason instead of computing something else.
    """
    _check_operands(a, b)
    spec = GemmSpec.of(a, b, bias=bias is not None, activation=activation, out_dtype=out_dtype)
    device = a.device
    if backend is None:
        chosen = registry.select(spec, device)
    else:
        chosen = registry.get(backend) if isinstance(backend, str) else backend
        if chosen.op != "mm":
            raise UnsupportedError(f"{chosen.name} is a {chosen.op!r} backend, not 'mm'")
        reason = chosen.runnable_reason(device) or chosen.refuse(spec)
        if reason is not None:
            raise UnsupportedError(reason)
    return chosen.run(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
