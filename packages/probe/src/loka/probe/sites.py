"""Which modules are GEMM sites, and how Probe reads a site's operands.

A GEMM site is a module whose forward runs one or more GEMMs `y = x @ W.T (+ b)`. Probe
finds three kinds:

1. every `nn.Linear`, subclasses included (an FP8 linear that is a drop-in `nn.Linear`
   subclass needs nothing more);
2. any module with a method `loka_gemm_operands(args, output)` (duck-typed, so that
   loka-mods need not import loka-probe), with an optional class attribute
   `loka_gemm_kind` ("linear" by default, "grouped" for a module holding several GEMMs);
3. any class registered with `register_site(cls, operands, kind=...)`.

`loka_gemm_operands` (or the registered `operands(module, args, output)`) is called after
the module's forward on sampled steps only, and returns one mapping per GEMM:

- `"input"`: the GEMM's first operand `[..., K]` as the GEMM sees it (for a fused
  norm+linear: the normalized input, recomputed here if the fused kernel never
  materializes it);
- `"weight"`: `[N, K]`;
- `"output"`: a tensor of the autograd graph whose gradient is this GEMM's `dY`;
- `"grad"` (optional): a function mapping the gradient of `"output"` to `dY [..., N]`, when
  `"output"` holds more than this GEMM's result (a grouped module's packed output);
- `"bias"` (optional, bool): whether the GEMM adds a bias.

A site claims its whole subtree: `nn.Linear` children of a site are not sites themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loka.schema.tables import SITE_KINDS

OperandsFn = Callable[[nn.Module, tuple[Any, ...], Any], Sequence[Mapping[str, Any]]]

_registry: dict[type, tuple[OperandsFn, str]] = {}


def register_site(cls: type, operands: OperandsFn, *, kind: str = "linear") -> None:
    """Make every module of class `cls` (and its subclasses) a GEMM site.

    `operands(module, args, output)` returns one mapping per GEMM, as described in this
    module's documentation. `kind` is "linear" (one GEMM), "grouped" (several GEMMs run as
    one site) or "bmm".
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_site needs an nn.Module subclass, got {cls!r}")
    if not callable(operands):
        raise TypeError(f"operands must be callable, got {type(operands).__name__}")
    if kind not in SITE_KINDS:
        raise ValueError(f"kind must be one of {SITE_KINDS}, got {kind!r}")
    _registry[cls] = (operands, kind)


def _linear_operands(module: nn.Module, args: tuple[Any, ...], output: Any) -> list[dict[str, Any]]:
    return [
        {
            "input": args[0],
            "weight": module.weight,
            "output": output,
            "bias": module.bias is not None,
        }
    ]


def _method_operands(
    module: nn.Module, args: tuple[Any, ...], output: Any
) -> Sequence[Mapping[str, Any]]:
    return module.loka_gemm_operands(args, output)


def site_kind_and_operands(module: nn.Module) -> tuple[str, OperandsFn] | None:
    """How to read the operands of `module` if it is a GEMM site, else None."""
    for cls in type(module).__mro__:
        if cls in _registry:
            operands, kind = _registry[cls]
            return kind, operands
    if callable(getattr(module, "loka_gemm_operands", None)):
        kind = getattr(module, "loka_gemm_kind", "linear")
        if kind not in SITE_KINDS:
            raise ValueError(
                f"{type(module).__name__}.loka_gemm_kind is {kind!r}; expected one of {SITE_KINDS}"
            )
        return kind, _method_operands
    if isinstance(module, nn.Linear):
        return "linear", _linear_operands
    return None


@dataclass(frozen=True)
class SiteSpec:
    name: str
    module: nn.Module
    kind: str
    operands: OperandsFn


def find_sites(model: nn.Module, exclude: Callable[[str], bool]) -> list[SiteSpec]:
    """Every GEMM site of `model` in module order; a site's descendants are not sites."""
    found: list[SiteSpec] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        hit = site_kind_and_operands(module)
        if hit is None:
            continue
        claimed.append(name)
        if exclude(name):
            continue
        kind, operands = hit
        found.append(SiteSpec(name or type(module).__name__, module, kind, operands))
    return found


@dataclass
class GemmCall:
    """One GEMM of one forward call, validated."""

    x: torch.Tensor  # [M, K] (a view of `input`)
    input: torch.Tensor  # as the module received it
    weight: torch.Tensor  # [N, K]
    output: torch.Tensor
    grad: Callable[[torch.Tensor], torch.Tensor] | None
    has_bias: bool


def read_calls(spec: SiteSpec, args: tuple[Any, ...], output: Any) -> list[GemmCall]:
    """The validated GEMMs of one forward call of `spec.module`."""
    calls = []
    for i, entry in enumerate(spec.operands(spec.module, args, output)):
        try:
            x, weight, out = entry["input"], entry["weight"], entry["output"]
        except KeyError as exc:
            raise ValueError(
                f"site {spec.name!r}: GEMM {i} lacks key {exc.args[0]!r} "
                "(needs 'input', 'weight', 'output')"
            ) from None
        if not all(isinstance(t, torch.Tensor) for t in (x, weight, out)):
            raise TypeError(f"site {spec.name!r}: GEMM {i} operands must be tensors")
        if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"site {spec.name!r}: GEMM {i} input {tuple(x.shape)} does not match weight "
                f"{tuple(weight.shape)} (expected input [..., K] and weight [N, K])"
            )
        calls.append(
            GemmCall(
                x.reshape(-1, x.shape[-1]),
                x,
                weight,
                out,
                entry.get("grad"),
                bool(entry.get("bias", False)),
            )
        )
    return calls
