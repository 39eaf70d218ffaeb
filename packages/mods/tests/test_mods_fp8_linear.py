"""Fp8Linear: each pass against the pure-torch emulation, the weight cache, delayed scaling,
padding, autocast, state_dict round trips and conversion."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import ops
from loka.mods.alignment import ShapeError
from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.fp8_linear import Fp8Linear, convert_to_fp8_linear, convert_to_linear
from loka.mods.reference import fp8_linear_reference
from loka.schema import Recipe

ROW = "e4m3:e4m3/row/dynamic"


def rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def data(M=24, K=64, N=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)  # uneven channels
    dy = torch.randn(M, N, generator=g) * 1e-3  # gradients are small: scales must follow
    linear = nn.Linear(K, N)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N, K, generator=g) / K**0.5)
        linear.bias.copy_(torch.randn(N, generator=g))
    return x, dy, linear


def run(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def test_bf16_config_is_exactly_nn_linear():
    x, dy, linear = data()
    want = run(linear, x, dy)
    linear.zero_grad()
    got = run(Fp8Linear.from_linear(linear, Fp8LinearConfig.bf16()), x, dy)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


CONFIGS = {
    "row": Fp8LinearConfig(),
    "tensor-e5m2-grads": Fp8LinearConfig.from_recipes(
        "e4m3:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic"
    ),
    "block": Fp8LinearConfig.from_recipes(
        "e4m3:e4m3/block/dynamic", "e4m3:e4m3/block/dynamic", "e4m3:e4m3/block/dynamic"
    ),
    "pow2-ub-mixed": Fp8LinearConfig(
        "e4m3:e4m3/row/dynamic/pow2/ub=64",
        "bf16",
        PassConfig("e5m2:e4m3/row/dynamic", "triton.fp8"),
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_passes_match_emulation(name):
    config = CONFIGS[name]
    x, dy, linear = data(seed=1)
    y, dx, dw, db = run(Fp8Linear.from_linear(linear, config), x, dy)
    ref = fp8_linear_reference(x, linear.weight.detach(), config, dy)
    bias = linear.bias.detach()
    # Emulation and kernels quantize to the same bytes; only float32-vs-float64 accumulation
    # and the bf16 output rounding separate them.
    for got, want in ((y, ref.y + bias), (dx, ref.dx), (dw, ref.dw)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    torch.testing.assert_close(db, dy.sum(0))
    exact = fp8_linear_reference(x, linear.weight.detach(), Fp8LinearConfig.bf16(), dy)
    bound = 0.08 if "e5m2" in name else 0.06  # FP8's own error, as the kernels README states
    for got, want, pass_ in (
        (y - bias, exact.y, "fwd"),
        (dx, exact.dx, "dgrad"),
        (dw, exact.dw, "wgrad"),
    ):
        error = rel(got, want)
        if getattr(config, pass_).is_bf16:
            assert error < 5e-3
        else:
            assert 1e-3 < error < bound, (pass_, error)


def test_recipe_objects_are_accepted():
    x, dy, linear = data(seed=2)
    config = Fp8LinearConfig(Recipe("e4m3", "e4m3", "row"), "bf16", "bf16")
    y, *_ = run(Fp8Linear.from_linear(linear, config), x, dy)
    ref = fp8_linear_reference(x, linear.weight.detach(), config)
    torch.testing.assert_close(y, ref.y + linear.bias.detach(), rtol=1e-2, atol=1e-2)


def test_leading_dims_and_nan_rows():
    x, _, linear = data(seed=3)
    module = Fp8Linear.from_linear(linear)
    x3 = x.view(4, 6, 64).clone()
    x3[1, 2, 5] = float("nan")
    y = module(x3)
    assert y.shape == (4, 6, 40)
    assert y[1, 2].isnan().all()  # the NaN reaches its row, never silently zeroed
    assert not y[0].isnan().any()
    with pytest.raises(ValueError, match="features"):
        module(torch.randn(3, 65))


class CountingQuantizations:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = ops.quantize_transpose_impl

        def counted(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(ops, "quantize_transpose_impl", counted)


def test_weight_is_quantized_once_per_optimizer_step(monkeypatch):
    x, dy, linear = data(seed=4)
    # fwd and dgrad quantize W alike (one quantize_transpose), x and dY use plain quantize.
    config = Fp8LinearConfig(ROW, ROW, "bf16")
    module = Fp8Linear.from_linear(linear, config)
    counter = CountingQuantizations(monkeypatch)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(3):  # gradient accumulation: three forwards, one step
        run(module, x, dy)
    assert counter.calls == 1
    optimizer.step()
    y, *_ = run(module, x, dy)
    assert counter.calls == 2
    ref = fp8_linear_reference(x, module.weight.detach(), config)  # the stepped weight
    torch.testing.assert_close(y, ref.y + module.bias.detach(), rtol=1e-2, atol=1e-2)
    module.load_state_dict(nn.Linear(64, 40).state_dict())  # an in-place copy
    with torch.no_grad():
        y = module(x)
    assert counter.calls == 3
    ref = fp8_linear_reference(x, module.weight.detach(), config)
    torch.testing.assert_close(y, ref.y + module.bias.detach(), rtol=1e-2, atol=1e-2)


def test_delayed_scaling_uses_the_amax_history():
    config = Fp8LinearConfig.from_recipes(
        "e4m3:e4m3/tensor/delayed3", "e5m2:e4m3/tensor/delayed3", "bf16"
    )
    x, dy, linear = data(seed=5)
    module = Fp8Linear.from_linear(linear, config)
    assert module.amax_history_input.shape == (3,)
    run(module, x, dy)  # first call: dynamic scales, amaxes recorded
    assert float(module.amax_history_input[0]) == float(x.abs().max())
    assert float(module.amax_history_grad_output[0]) == float(dy.abs().max())
    assert float(module.amax_history_weight[0]) == float(linear.weight.detach().abs().max())
    small_x, small_dy = x * 0.25, dy * 0.25
    y, dx, _, _ = run(module, small_x, small_dy)  # scales from the larger history amaxes
    w = linear.weight.detach()
    ref = fp8_linear_reference(
        small_x, w, config, small_dy, input_amax=x.abs().max().reshape(1),
        weight_amax=w.abs().max().reshape(1), grad_amax=dy.abs().max().reshape(1),
    )  # fmt: skip
    torch.testing.assert_close(y, ref.y + linear.bias.detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx, ref.dx, rtol=1e-2, atol=1e-2 * float(ref.dx.abs().max()))
    assert float(module.amax_history_input[1]) == float(x.abs().max())  # shifted back
    dynamic = fp8_linear_reference(small_x, w, config)
    assert not torch.allclose(ref.y, dynamic.y)  # the history really changed the scale


def test_each_amax_history_is_used_once_it_holds_a_value():
    """The history-or-current choice is made per role on the device (no Python flag):
    an inference call records x's amax, so the next training call scales x from it, while
    dY, whose history is still empty, gets its current (dynamic) scale."""
    config = Fp8LinearConfig.from_recipes(
        "e4m3:e4m3/tensor/delayed3", "e5m2:e4m3/tensor/delayed3", "bf16"
    )
    x, dy, linear = data(seed=6)
    module = Fp8Linear.from_linear(linear, config)
    with torch.no_grad():
        module(x * 3)  # not a power of two: a 4x amax would give the same FP8 bytes
    assert not module.amax_history_grad_output.any()
    y, dx, _, _ = run(module, x, dy)
    w, bias = linear.weight.detach(), linear.bias.detach()
    ref = fp8_linear_reference(
        x, w, config, dy, input_amax=(x * 3).abs().max().reshape(1),
        weight_amax=w.abs().max().reshape(1),
    )  # fmt: skip
    dynamic = fp8_linear_reference(x, w, config)
    # Only the bf16 output rounding (~0.3%) separates y from the emulation of its scales;
    # dynamic scales for x would be ~3% off.
    assert rel(y, ref.y + bias) < 0.01 < 0.02 < rel(y, dynamic.y + bias)
    torch.testing.assert_close(dx, ref.dx, rtol=1e-2, atol=1e-2 * float(ref.dx.abs().max()))
    assert float(module.amax_history_grad_output[0]) == float(dy.abs().max())


def test_padding_runs_an_aligned_backend_on_odd_shapes():
    # triton.fp8.tma needs its GEMM's k % 16 and n % 8: K and the tokens M (fwd's and
    # wgrad's k), N (dgrad's k).
    x, dy, linear = data(M=30, K=40, N=20, seed=6)
    tma = Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="triton.fp8.tma")
    with pytest.raises(ShapeError, match="pad=True"):
        Fp8Linear.from_linear(linear, tma)
    module = Fp8Linear.from_linear(linear, tma.replace(pad=True))
    assert module.plan.multiples.pad(30, 40, 20) == (32, 48, 32)
    y, dx, dw, _ = run(module, x, dy)
    assert (y.shape, dx.shape, dw.shape) == ((30, 20), (30, 40), (20, 40))
    ref = fp8_linear_reference(x, linear.weight.detach(), tma, dy)
    for got, want in ((y, ref.y + linear.bias.detach()), (dx, ref.dx), (dw, ref.dw)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def test_autocast_bf16():
    x, dy, linear = data(seed=7)
    module = Fp8Linear.from_linear(linear, Fp8LinearConfig(ROW, "bf16", ROW))
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(xg)
        reference = linear(xg)
    assert y.dtype == reference.dtype == torch.bfloat16
    y.float().backward(dy)
    assert xg.grad.dtype == torch.float32 and module.weight.grad.dtype == torch.float32
    assert rel(y, reference) < 0.06


def test_state_dict_round_trips_both_ways():
    x, _, linear = data(seed=8)
    module = Fp8Linear(64, 40)
    module.load_state_dict(linear.state_dict())  # nn.Linear -> Fp8Linear, strict
    assert module.state_dict().keys() == linear.state_dict().keys()
    back = nn.Linear(64, 40)
    back.load_state_dict(module.state_dict())  # Fp8Linear -> nn.Linear, strict
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias)
    delayed = Fp8LinearConfig.from_recipes("e4m3:e4m3/tensor/delayed4", "bf16", "bf16")
    first = Fp8Linear(64, 40, config=delayed)
    first.load_state_dict(linear.state_dict())  # no history yet: allowed, starts empty
    first(x).square().sum().backward()  # a training call fills the histories
    second = Fp8Linear(64, 40, config=delayed)
    second.load_state_dict(first.state_dict())
    assert torch.equal(second.amax_history_input, first.amax_history_input)
    with torch.no_grad():
        assert torch.equal(second(x * 0.5), first(x * 0.5))  # same history, same scales


def test_convert_and_back_share_parameters():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 8))
    params = list(model.parameters())
    convert_to_fp8_linear(model, module_filter_fn=lambda mod, fqn: fqn != "3")
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "ReLU", "Fp8Linear", "Linear"]
    assert list(model.parameters()) == params
    convert_to_linear(model)
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    assert list(model.parameters()) == params
    single = convert_to_fp8_linear(nn.Linear(16, 16))
    assert type(single) is Fp8Linear


def test_conversion_refuses_unsupported_shapes_and_changes_nothing():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 20))
    config = Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.scaled_mm")
    with pytest.raises(ShapeError, match=r"'1'.*N=20.*multiple of 16"):
        convert_to_fp8_linear(model, config)
    assert all(type(m) is nn.Linear for m in model)


def test_device_move_rebuilds_the_cache():
    x, _, linear = data(seed=9)
    module = Fp8Linear.from_linear(linear)
    with torch.no_grad():
        before = module(x)
        module.to(torch.float64).to(torch.float32)  # dtype round trip: new weight storage
        after = module(x)
    assert torch.equal(before, after)
    assert module._weight_cache[0].dtype == torch.float8_e4m3fn  # not cast with the module


def test_bias_gradient_as_a_gemm_on_the_kernel_path():
    # The custom-op path (Triton kernels, interpreted here) takes the same option.
    grads = {}
    for form in ("sum", "gemm"):
        torch.manual_seed(0)
        module = Fp8Linear(32, 16, config=Fp8LinearConfig(bias_grad=form))
        module(torch.randn(16, 32)).square().sum().backward()
        grads[form] = module.bias.grad
    assert module.plan.bias_grad == "gemm"
    torch.testing.assert_close(grads["gemm"], grads["sum"], rtol=1e-5, atol=1e-5)
