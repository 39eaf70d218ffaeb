"""A recipe's ``center`` on the torch-native backends: fwd and dgrad quantize their first
operand less its token mean and add the mean's product back, equal to the reference, far
closer to the exact product on what varies over the batch, and checked where it cannot run."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.reference import fp8_linear_reference

CPU = "torch.native.cpu"
ROW, CENTER = "e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/center"


def config(fwd: str, dgrad: str, wgrad: str = ROW, backend: str = CPU) -> Fp8LinearConfig:
    return Fp8LinearConfig(*(PassConfig(r, backend) for r in (fwd, dgrad, wgrad)))


def collapsed(rows: int, cols: int, spread: float, g: torch.Generator) -> torch.Tensor:
    """One vector every row shares plus `spread` of it per row (states on a loss plateau)."""
    return torch.randn(1, cols, generator=g) + spread * torch.randn(rows, cols, generator=g)


def varying_error(got: torch.Tensor, want: torch.Tensor) -> float:
    err = got.double() - want.double()
    return float((err - err.mean(0)).norm() / (want - want.mean(0)).norm())


@pytest.mark.parametrize("recipes", [(CENTER, ROW), (ROW, CENTER), (CENTER, CENTER)])
def test_a_centered_pass_is_its_reference(recipes):
    cfg = config(*recipes)
    g = torch.Generator().manual_seed(0)
    module = Fp8Linear(64, 32, bias=False, config=cfg)
    x = collapsed(48, 64, 0.05, g).requires_grad_()
    dy = collapsed(48, 32, 0.05, g)
    module(x).backward(dy)
    ref = fp8_linear_reference(x.detach(), module.weight.detach(), cfg, dy)
    y = module(x.detach())
    # The output's bf16 rounding, and the mean's product's: it rides in the GEMM's bf16 bias.
    for got, want in ((y, ref.y), (x.grad, ref.dx)):
        tol = {"rtol": 2**-7, "atol": 2**-8 * float(want.abs().max())}
        torch.testing.assert_close(got, want.to(got.dtype), **tol)
    tol = {"rtol": 2**-7, "atol": 1e-4}
    torch.testing.assert_close(module.weight.grad, ref.dw, **tol)


def test_centering_keeps_what_varies_over_the_batch():
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(128, 96)
    x = collapsed(256, 128, 0.01, g).requires_grad_()
    dy = collapsed(256, 96, 0.01, g)
    exact = x.detach().double() @ linear.weight.detach().double().T + linear.bias.detach().double()
    exact_dx = dy.double() @ linear.weight.detach().double()
    # What the bf16 output's own rounding loses of the varying part: no recipe does better.
    floor = max(varying_error(t.bfloat16(), t) for t in (exact, exact_dx))
    errors = {}
    for name, recipe in (("plain", ROW), ("center", CENTER)):
        module = Fp8Linear.from_linear(nn.Linear(128, 96), config(recipe, recipe))
        module.load_state_dict(linear.state_dict())
        xi = x.detach().clone().requires_grad_()
        y = module(xi)
        y.backward(dy)
        errors[name] = (varying_error(y.detach(), exact), varying_error(xi.grad, exact_dx))
    # rowwise e4m3 loses more than all of what varies; centered, little beyond the rounding
    assert min(errors["plain"]) > 1.0 > 5 * floor
    assert max(errors["center"]) < 1.2 * floor + 0.04


def test_a_prequantized_centering_forward_serves_what_training_computes():
    g = torch.Generator().manual_seed(2)
    module = Fp8Linear(64, 32, config=config(CENTER, ROW))
    x = collapsed(40, 64, 0.02, g)
    with torch.no_grad():
        trained = module(x)
        assert module.prequantize_weight()
        served = module(x)
        torch.testing.assert_close(served, trained, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"a centering forward .* measures each batch's mean"):
            module.set_static_input_amax(4.0)


def test_center_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="center is for fwd and dgrad"):
        config(ROW, ROW, CENTER)
    with pytest.raises(ValueError, match="runs on a torch-native backend"):
        Fp8LinearConfig(fwd=CENTER)
    with pytest.raises(ValueError, match="runs on a torch-native backend"):
        config(CENTER, ROW, ROW, backend="torch.scaled_mm")


def test_a_compiled_centered_linear_trains_like_the_eager_one():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), Fp8Linear(64, 96, config=config(CENTER, CENTER)))
    eager = __import__("copy").deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = collapsed(32, 64, 0.05, g)
        for module, optimizer in zip((compiled, eager), optimizers, strict=True):
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
