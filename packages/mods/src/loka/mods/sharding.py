"""Modules whose parameters torch.distributed's FSDP2 (``fully_shard``) manages.

FSDP2 shards a module's parameters into DTensors and, around each forward and backward,
all-gathers them and sets the unsharded tensors on the very module objects it sharded; it
also swaps the class of each module it is called on for a subclass ``FSDP<Class>`` that
carries its hooks. A module put in such a module's place never receives the unsharded
weights (it would multiply DTensor shards), and the one FSDP fills is no longer in the
model. So a managed linear becomes an `Fp8Linear` in place: the same object with its class
swapped (FSDP's class kept in front of it) and swapped back on undo. Mods that replace
modules or rewrite parameters around a linear (norm fusion, grouping, smoothing, norm-bias
folding) are refused for managed modules: their parameters are shards outside forward.

Either order works: convert (or apply a plan) before ``fully_shard``, as torchao's float8
training asks, and FSDP shards `Fp8Linear`s like any linear; or after, as a `Session` does
on a model that is already sharded.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["base_class", "fsdp_managed", "local_tensor", "swap_base_class"]

_WRAPPED: dict[tuple[type, type], type] = {}  # (FSDP's mixin, new base) -> its class


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _wrapper_mixin(cls: type) -> type | None:
    """FSDP's mixin (``FSDPModule``, or replicate's subclass of it) when `cls` is a class
    that ``fully_shard`` made (``FSDP<Base>``: bases (mixin, Base)), else None."""
    if getattr(cls, "_orig_cls_mro_index", None) is None or len(cls.__bases__) != 2:
        return None
    return cls.__bases__[0]


def base_class(module: nn.Module) -> type:
    """The class of `module` under FSDP's wrapper class (`nn.Linear` for ``FSDPLinear``);
    its own class when FSDP did not wrap it."""
    cls = type(module)
    return cls.__bases__[1] if _wrapper_mixin(cls) is not None else cls


def fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP2 manages `module`'s own parameters: ``fully_shard`` was called on it, or
    on a parent, which left them as DTensor shards (so they must stay where FSDP puts them)."""
    if _wrapper_mixin(type(module)) is not None:
        return True
    dtensor = _dtensor_type()
    return dtensor is not None and any(
        isinstance(p, dtensor) for p in module.parameters(recurse=False)
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP2 parameter or gradient at rest); any other
    tensor itself."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def swap_base_class(module: nn.Module, new_base: type) -> type:
    """Give `module` the class `new_base` (a subclass or base of its base class), keeping
    FSDP's wrapper in front of it when there is one; returns the class it had."""
    cls = type(module)
    mixin = _wrapper_mixin(cls)
    if mixin is None:
        module.__class__ = new_base
        return cls
    if new_base is cls.__bases__[1]:
        target = cls
    else:
        target = _WRAPPED.get((mixin, new_base))
        if target is None:
            old_base = cls.__bases__[1].__name__
            prefix = cls.__name__[: -len(old_base)] if cls.__name__.endswith(old_base) else ""
            # FSDP's own classes refuse deepcopy the same way: copy what it set on them.
            extra = {k: v for k, v in vars(cls).items() if k == "__deepcopy__"}
            target = type(prefix + new_base.__name__, (mixin, new_base), extra)
            _WRAPPED[(mixin, new_base)] = target
    module.__class__ = target
    return cls
