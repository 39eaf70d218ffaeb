"""``convert_to_lordba``: wrap a model's linears with fresh LoRDBA adapters, and the module swap
it shares with loading."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from loka.lordba.config import LoRDBAConfig
from loka.lordba.module import LoRDBALinear


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
    """Wrap every ``nn.Linear`` (that ``module_filter_fn(module, fqn)`` accepts) in a fresh,
    zero-output :class:`LoRDBALinear`; base weights are frozen. Returns the model (a new root
    only when the model itself is a linear)."""
    config = config or LoRDBAConfig()
    chosen = {
        name: LoRDBALinear(module, config)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and (module_filter_fn is None or module_filter_fn(module, name))
    }
    if not chosen:
        raise ValueError("convert_to_lordba: no nn.Linear module matched")
    return replace_modules(model, chosen)
