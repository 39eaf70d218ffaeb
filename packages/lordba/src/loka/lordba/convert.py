"""``convert_to_lordba``: wrap a model's linears with fresh LoRDBA adapters, and the module swap
it shares with loading."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from loka.lordba.config import LoRDBAConfig
from loka.lordba.module import LoRDBALinear
from loka.lordba.quantized import Fp8WeightOnlyLinear


def is_linear_base(module: nn.Module) -> bool:
    """A linear a fresh adapter may wrap: exactly ``nn.Linear`` (whatever its weight: plain or
    a quantized tensor subclass; subclasses such as MultiheadAttention's ``out_proj`` are read
    as weights and never called), LoKA's FP8 weight-only linear, or ``loka.mods.Fp8Linear``."""
    from loka.mods.fp8_linear import Fp8Linear

    return type(module) in (nn.Linear, Fp8WeightOnlyLinear, Fp8Linear)


def replace_modules(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """Put each ``replacements[name]`` at ``name`` in ``model``; returns the (possibly new) root.

    All names are resolved before anything changes, so an unknown name changes nothing.
    """
    parents = []
    for name in replacements:
        if name == "":
            continue
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            parent.get_submodule(child)
        except AttributeError as error:
            raise ValueError(f"model has no module named {name!r}") from error
        parents.append((parent, child, replacements[name]))
    for parent, child, module in parents:
        setattr(parent, child, module)
    return replacements.get("", model)


def convert_to_lordba(
    model: nn.Module,
    config: LoRDBAConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Wrap every linear (``nn.Linear``, also with a torchao-quantized weight, an
    ``Fp8WeightOnlyLinear`` or a ``loka.mods.Fp8Linear``; that ``module_filter_fn(module, fqn)``
    accepts) in a fresh,
    zero-output :class:`LoRDBALinear`; base weights are frozen. Returns the model (a new root
    only when the model itself is a linear)."""
    config = config or LoRDBAConfig()
    chosen = {
        name: LoRDBALinear(module, config)
        for name, module in model.named_modules()
        if is_linear_base(module) and (module_filter_fn is None or module_filter_fn(module, name))
    }
    if not chosen:
        raise ValueError("convert_to_lordba: no nn.Linear module matched (plain, quantized or FP8)")
    return replace_modules(model, chosen)
