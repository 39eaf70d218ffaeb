"""Kernel launches with little host work.

`kernel[grid](*args)` makes Triton bind and specialize every argument, build a cache key,
find the compiled kernel and check its globals on each call: tens of microseconds of Python,
more than a quantization kernel runs on an H200. A `Launcher` pays that once per *plan* and
afterwards hands the arguments straight to the compiled kernel's launcher.

A plan key must determine everything Triton specializes on, so that one compiled kernel
serves every call with that key: the constexprs, the dtypes of pointer arguments, 16-byte
alignment of every pointer, and each integer argument's value being 1 or a multiple of 16
(keys hold the shapes and strides the integers come from). Outputs come from torch's caching
allocator and are always aligned; callers put the alignment of caller-owned tensors in keys.

Under Triton's interpreter, and while a launch hook is installed (a profiler), every call
takes Triton's own path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime.autotuner import Autotuner

from loka.kernels.runtime import interpreting

MAX_PLANS = 4096  # per kernel; past it the cache starts over (shapes that never repeat)
# False: every launch takes Triton's own path (for debugging, and for benchmarks measuring
# what the cache saves).
ENABLED = True


class Plan:
    """A compiled kernel with its grid and constexpr values, ready to launch."""

    __slots__ = ("compiled", "device", "grid", "meta", "tail")

    def __init__(
        self, compiled: CompiledKernel, device: int, grid: tuple, meta: dict, tail: tuple
    ) -> None:
        self.compiled = compiled
        self.device = device
        self.grid = (*grid, 1, 1)[:3]
        self.meta = meta  # constexprs by name, the autotuner's choice included
        self.tail = tail  # constexpr values in signature order, after the runtime arguments


def _current_device() -> int:
    return torch.cuda.current_device()


# What Triton itself launches on: the raw handle of the current stream, without building a
# torch.cuda.Stream object per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


class Launcher:
    """Launches one ``@triton.jit`` kernel (or an autotuned one) with per-plan caching.

    The kernel's runtime arguments must come first in its signature and its constexprs after
    them (true of every kernel in this package).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        self._plans: dict[tuple, Plan] = {}

    def lookup(self, key: tuple) -> Plan | None:
        """The plan cached for `key` on the current device, or None (also when a launch
        hook is installed, or under the interpreter)."""
        if not ENABLED or interpreting() or knobs.runtime.launch_enter_hook.calls:
            return None
        return self._plans.get((_current_device(), key))

    def launch(self, plan: Plan, args: tuple) -> None:
        """Start `plan`'s kernel with these runtime arguments on the current stream."""
        c = plan.compiled
        g0, g1, g2 = plan.grid
        c.run(
            g0, g1, g2, _stream(plan.device), c.function,
            c.packed_metadata, None, None, None, *args, *plan.tail,
        )  # fmt: skip

    def __call__(
        self,
        key: tuple,
        grid: tuple | Callable[[dict], tuple],
        args: tuple,
        constexprs: dict,
        **options: Any,
    ) -> None:
        """Launch with the plan cached for `key`, or through Triton (compiling or autotuning
        as needed), caching the plan. `grid` is a tuple, or a function of the constexprs (the
        autotuner's choice included)."""
        plan = self.lookup(key)
        if plan is not None:
            self.launch(plan, args)
            return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        if interpreting() or not isinstance(compiled, CompiledKernel):
            return
        meta = dict(constexprs)
        if isinstance(self.kernel, Autotuner):
            meta.update(self.kernel.best_config.kwargs)
        names = self._fn.arg_names[len(args) :]
        if set(names) != set(meta):
            raise TypeError(
                f"{self._fn.__name__}: constexprs {sorted(meta)} do not match the signature's "
                f"trailing parameters {names}"
            )
        if callable(grid):
            grid = grid({**dict(zip(self._fn.arg_names, args, strict=False)), **meta})
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        device = _current_device()
        plan = Plan(compiled, device, tuple(grid), meta, tuple(meta[n] for n in names))
        self._plans[(device, key)] = plan
