"""`fp8_mm`: one NT GEMM ``out = activation(a @ b.T + bias)`` through a registered backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.registry import Backend, GemmSpec, UnsupportedError, registry
from loka.kernels.runtime import interpreting


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


_CHOICES: dict[tuple, Backend] = {}


def _operand_key(t: Fp8Tensor | torch.Tensor) -> tuple:
    if isinstance(t, Fp8Tensor):
        return (t.data.shape, t.fmt, t.granularity, t.block)
    return (t.shape,)


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
    device = a.device
    key = None
    if backend is None or isinstance(backend, str):
        # The choice depends only on these: made once, then looked up (host time matters
        # as much as kernel time for the small GEMMs of recommendation models).
        key = (_operand_key(a), _operand_key(b), bias is not None, activation, out_dtype,
               device, backend, registry.version, interpreting())  # fmt: skip
        chosen = _CHOICES.get(key)
        if chosen is not None:
            return chosen.run(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
    spec = GemmSpec.of(a, b, bias=bias is not None, activation=activation, out_dtype=out_dtype)
    chosen = _choose("mm", [spec], device, backend)
    if key is not None:
        if len(_CHOICES) >= 4096:
            _CHOICES.clear()
        _CHOICES[key] = chosen
    return chosen.run(a, b, bias=bias, activation=activation, out_dtype=out_dtype)


def grouped_mm(
    a: Sequence[Fp8Tensor | torch.Tensor],
    b: Sequence[Fp8Tensor | torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | Backend | None = None,
) -> list[torch.Tensor]:
    """``[activation(a[g] @ b[g].T + bias[g]) for g]``: many GEMMs, equal or different shapes,
    through a backend of op "grouped_mm" (default: one Triton launch for all groups)."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"a and b must be non-empty lists of one length, got {len(a)} and {len(b)}"
        )
    for ag, bg in zip(a, b, strict=True):
        _check_operands(ag, bg)
    specs = [
        GemmSpec.of(ag, bg, bias=bias is not None, activation=activation, out_dtype=out_dtype)
        for ag, bg in zip(a, b, strict=True)
    ]
    chosen = _choose("grouped_mm", specs, a[0].device, backend)
    return chosen.run(a, b, bias=bias, activation=activation, out_dtype=out_dtype)


def _choose(
    op: str, specs: list[GemmSpec], device: torch.device, backend: str | Backend | None
) -> Backend:
    """The named backend if it runs every spec, else the best that does; UnsupportedError
    with the reasons otherwise."""
    if backend is None:
        candidates = registry.backends(op)
    else:
        candidates = [registry.get(backend) if isinstance(backend, str) else backend]
        if candidates[0].op != op:
            raise UnsupportedError(
                f"{candidates[0].name} is a {candidates[0].op!r} backend, not {op!r}"
            )
    reasons = []
    for candidate in candidates:
        reason = candidate.runnable_reason(device) or next(
            (r for r in map(candidate.refuse, specs) if r is not None), None
        )
        if reason is None:
            return candidate
        reasons.append(reason)
    raise UnsupportedError(f"no {op} backend runs this request: " + "; ".join(reasons))
