"""An overflow upstream of an FP8 linear stays visible: an infinite input becomes NaN in the
FP8 cast instead of the format's largest value, so that fp16 training's GradScaler sees it
and skips the step, as it does for nn.Linear."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig

BACKENDS = ["torch.native.cpu", "triton.fp8"]


def fp8_linear(backend: str, bias: bool = False) -> Fp8Linear:
    config = Fp8LinearConfig(**{
        p: PassConfig("e4m3:e4m3/row/dynamic", backend) for p in ("fwd", "dgrad", "wgrad")
    })  # fmt: skip
    torch.manual_seed(0)
    return Fp8Linear(32, 16, bias=bias, config=config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_gradient_or_input_is_not_made_finite(backend: str) -> None:
    module = fp8_linear(backend).half()
    x = torch.randn(8, 32, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(8, 16, dtype=torch.float16)
    module(x).backward(dy)
    assert torch.isfinite(x.grad).all() and torch.isfinite(module.weight.grad).all()
    x.grad = module.weight.grad = None
    dy[3, 2] = float("inf")  # an fp16 gradient that overflowed
    module(x).backward(dy)
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(module.weight.grad).all()
    bad = x.detach().clone()
    bad[1, 1] = -float("inf")
    assert not torch.isfinite(module(bad)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scaler_skips_the_overflowing_step_as_for_nn_linear(backend: str) -> None:
    """fp32 weights, fp16 autocast, a loss scale that overflows the fp16 gradient: the
    scaler skips the step (weights unchanged) and halves its scale, for FP8 as for bf16
    nn.Linear. Before: FP8 saturated the Inf, the gradients looked finite and the step ran."""
    results = {}
    for name, module in (("linear", nn.Linear(32, 16, bias=False)), ("fp8", fp8_linear(backend))):
        with torch.no_grad():
            module.weight.copy_(fp8_linear(backend).weight)
        before = module.weight.detach().clone()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = module(x).float().pow(2).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        results[name] = (torch.equal(module.weight, before), scaler.get_scale())
    assert results["linear"] == (True, 2.0**39)  # skipped, scale halved
    assert results["fp8"] == results["linear"]


def test_the_compiled_native_path_keeps_the_overflow_too() -> None:
    """Under torch.compile the native quantization is traced in its own formulation."""
    torch._dynamo.reset()
    module = fp8_linear("torch.native.cpu").half()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 32, dtype=torch.float16, requires_grad=True)
    dy = torch.randn(8, 16, dtype=torch.float16)
    dy[0, 0] = -float("inf")
    compiled(x).backward(dy)
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(module.weight.grad).all()
    bad = x.detach().clone()
    bad[2, 3] = float("inf")
    assert not torch.isfinite(compiled(bad)).all()
