"""Host time: what running one pass of a linear in FP8 costs the CPU, beyond bf16.

Kernel times are device times; an eager training step of a recommendation model is often
bound by the host instead (hundreds of small ops, each a Python call and a launch), and an
FP8 pass adds host work of its own: the autograd function, the quantization launches, the
FP8 GEMM's dispatch and, once per optimizer step, the re-quantization of the weight. A pass
that wins on the device can lose the step on the host.

`host_overhead_ms` measures it where it happens: an `Fp8Linear` running only that pass in
FP8 (the other two in bf16) against an `nn.Linear` of the same shape, forward and backward,
the weight touched before every call as an optimizer step would (so its FP8 copy is re-made),
timed on the host clock over calls that do not wait for the device (a small M keeps the
device ahead of the host, so the launch queue never blocks). The difference per call is the
pass's host overhead. It barely depends on the shape, so it is measured once per backend,
speed key and pass. Compiled plans do not pay it: their passes run inside the graph.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from loka.schema import PASSES, Recipe

HOST_M = 128
_CALLS = 30
_REPEATS = 5
_MEASURED: dict[tuple, float] = {}


def host_ms_per_call(
    module: nn.Module, x: torch.Tensor, touch_weight: bool = True, calls: int = _CALLS
) -> float:
    """Median host milliseconds of one forward + backward of `module` on `x`, the weight
    touched first (a new version, as after an optimizer step) unless `touch_weight` is False."""
    weight = module.weight

    def call() -> None:
        if touch_weight:
            with torch.no_grad():
                weight.add_(0.0)
        module(x).sum().backward()

    for _ in range(3):
        call()
    if x.is_cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
        if x.is_cuda:
            torch.cuda.synchronize()
    return statistics.median(times)


def host_overhead_ms(
    backend: str, recipe: Recipe | str, pass_: str, K: int, N: int, device: torch.device | str
) -> float:
    """Host milliseconds per training step that running `pass_` of a ``[K -> N]`` linear
    with `recipe` on `backend` adds over bf16 (0 for bf16 and for traceable backends, which
    run inside a compiled graph; never negative)."""
    from loka.kernels import registry
    from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig

    r = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe)
    if r.is_bf16 or registry.get(backend).traceable:
        return 0.0
    device = torch.device(device)
    key = (backend, r.a_format, r.b_format, r.granularity, r.scaling, pass_, device.type)
    if key in _MEASURED:
        return _MEASURED[key]
    torch.manual_seed(0)
    passes = {p: PassConfig(str(r), backend) if p == pass_ else PassConfig("bf16") for p in PASSES}
    fp8 = Fp8Linear(K, N, device=device, config=Fp8LinearConfig(**passes))
    bf16 = nn.Linear(K, N, device=device)
    x = torch.randn(HOST_M, K, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        base = host_ms_per_call(bf16, x)
        extra = host_ms_per_call(fp8, x) - base
    _MEASURED[key] = max(0.0, extra)
    return _MEASURED[key]
