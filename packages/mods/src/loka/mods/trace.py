"""What a model does with its modules on a sample batch, seen through forward hooks: which
norm's output each linear consumes, and what each container of parallel linears feeds them.

Hooks see real calls, so this works on models that `torch.fx` cannot trace (data-dependent
control flow, jagged batches). What hooks cannot see (another consumer of a norm's output,
say a residual) is caught afterwards by comparing the transformed model's outputs on the
same batch (`run_model`, `outputs_match`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from loka.mods.norm_linear import NORM_TYPES

__all__ = [
    "trace_norm_consumers",
]


@dataclass
class ConsumerTrace:
    """Per norm: how often it ran and which linear consumed each of its outputs."""

    norm_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (norm, linear) -> number of calls in which the linear's input was the norm's output
    consumed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    linear_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def consumers(self, norm: str) -> list[str]:
        return [lin for (n, lin) in self.consumed if n == norm]

    def exclusive_pairs(self) -> list[tuple[str, str]]:
        """(norm, linear) where every call of the norm fed exactly one call of that linear,
        and every call of that linear took that norm's output: candidates for fusion."""
        pairs = []
        for (norm, linear), count in self.consumed.items():
            if (
                len(self.consumers(norm)) == 1
                and count == self.norm_calls[norm] == self.linear_calls[linear]
            ):
                pairs.append((norm, linear))
        return pairs


def _call(model: nn.Module, example: Any) -> Any:
    with _serving_autocast(model, example):
        return model(*example) if isinstance(example, tuple) else model(example)


def _serving_autocast(model: nn.Module, example: Any):
    """Autocast to the model's dtype when the model can only run that way: all floating
    parameters in bf16 or fp16, float32 tensors in the sample and no autocast active (a
    served bf16 model fed float32 features, which its owner runs under autocast). Otherwise
    (an fp32 model, a caller's own autocast) the model runs as it is called."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    leaves = [t for t in tree_leaves(example) if isinstance(t, torch.Tensor)]
    if len(dtypes) != 1 or not dtypes <= {torch.bfloat16, torch.float16} or not leaves:
        return nullcontext()
    if not any(t.dtype == torch.float32 for t in leaves):
        return nullcontext()
    device_type = leaves[0].device.type
    if torch.is_autocast_enabled(device_type):
        return nullcontext()
    return torch.autocast(device_type, dtype=next(iter(dtypes)))


def run_model(model: nn.Module, example: Any, seed: int = 0) -> Any:
    """The model's output on `example` (a tuple is unpacked as positional arguments), in eval
    mode, without grad, with a fixed RNG; the model's train/eval state is restored."""
    modes = {m: m.training for m in model.modules()}
    devices = sorted({t.device.index or 0 for t in tree_leaves(example) if _is_cuda(t)})
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return _call(model, example)
    finally:
        for module, training in modes.items():
            module.training = training


def _is_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def outputs_match(a: Any, b: Any) -> str | None:
    """None if two model outputs agree to the rounding of their dtype, else how they differ."""
    la, lb = tree_leaves(a), tree_leaves(b)
    if len(la) != len(lb):
        return f"{len(la)} output leaves against {len(lb)}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f"output leaf {i}: {x!r} != {y!r}"
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i}: {x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)}"
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return f"output {i} differs"
            continue
        xf, yf = x.float(), y.float()
        if not torch.equal(xf.isnan(), yf.isnan()):
            return f"output {i}: NaN in different places"
        both = ~yf.isnan()
        if not both.any():
            continue
        # Reassociated sums (one batched GEMM for many) differ from the original in the last
        # bits only; anything structural is orders of magnitude above this.
        rtol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 3e-2
        scale = yf[both].abs().amax().clamp_min(1e-30)
        worst = (xf[both] - yf[both]).abs().amax()
        if not bool(worst <= rtol * scale):
            return f"output {i}: max abs difference {float(worst):.3g} (scale {float(scale):.3g})"
    return None


@contextmanager
def _hooks(handles: list) -> Iterable[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_norm_consumers(model: nn.Module, example: Any) -> ConsumerTrace:
    """Run `model` on `example` and record which linear took each norm's output as its input
    (by tensor identity)."""
    trace = ConsumerTrace()
    outputs: dict[int, tuple[str, torch.Tensor]] = {}
    handles = []

    def after_norm(name: str):
        def hook(module, args, output):
            trace.norm_calls[name] += 1
            if isinstance(output, torch.Tensor):
                outputs[id(output)] = (name, output)  # the tensor is kept alive: ids stay unique

        return hook

    def before_linear(name: str):
        def hook(module, args):
            trace.linear_calls[name] += 1
            if args and isinstance(args[0], torch.Tensor):
                hit = outputs.get(id(args[0]))
                if hit is not None and hit[1] is args[0]:
                    trace.consumed[(hit[0], name)] += 1

        return hook

    for name, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            handles.append(module.register_forward_hook(after_norm(name)))
        elif isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(before_linear(name)))
    with _hooks(handles):
        run_model(model, example)
    return trace


def input_channel_amax(
    model: nn.Module, names: Iterable[str], batches: Iterable[Any]
) -> dict[str, torch.Tensor]:
    """Per listed linear: the largest |input| of each input channel over all rows of all
    `batches` (float32 ``[in_features]``, NaN and Inf ignored): the activation statistics of
    outlier smoothing, from a short calibration pass."""
    amax: dict[str, torch.Tensor] = {}
    handles = []

    def before(name: str):
        def hook(module, args):
            x = args[0].detach()
            a = x.reshape(-1, x.shape[-1]).float().abs()
            a = torch.where(a.isfinite(), a, torch.zeros_like(a)).amax(dim=0)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)

        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_pre_hook(before(name)))
    with _hooks(handles):
        for batch in batches:
            run_model(model, batch)
    missing = [n for n in names if n not in amax]
    if missing:
        raise ValueError(f"calibration batches never reached {missing}")
    return amax
