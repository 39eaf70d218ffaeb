"""LoRDBA over frozen quantized bases (torchao int8 / FP8 weight-only, LoKA's FP8 weight-only
linear, loka.mods.Fp8Linear): inference and training against the same adapter over the
dequantized base."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from loka.lordba import (
    Fp8WeightOnlyLinear,
    LoRDBAConfig,
    LoRDBALinear,
    convert_to_lordba,
    dequantized_linear,
    dequantized_weight,
    load_lordba,
    quantize_fp8_weights,
    save_lordba,
)
from loka.lordba.quantized import plain_weight

torchao_quant = pytest.importorskip("torchao.quantization")


def _torchao_int8(linear):
    torchao_quant.quantize_(linear, torchao_quant.Int8WeightOnlyConfig())
    return linear


def _torchao_fp8(linear):
    torchao_quant.quantize_(linear, torchao_quant.Float8WeightOnlyConfig())
    return linear


def _loka_fp8(linear):
    return Fp8WeightOnlyLinear.from_linear(linear)


QUANTIZERS = {"torchao_int8": _torchao_int8, "torchao_fp8": _torchao_fp8, "loka_fp8": _loka_fp8}


def _adapter_state(module):
    return {k: v for k, v in module.state_dict().items() if not k.startswith("base.")}


def _pair(quantize, dtype, backend="torch", seed=0):
    """The same trained-like adapter over a quantized base and over its dequantized copy."""
    torch.manual_seed(seed)
    base = quantize(nn.Linear(48, 40).to(dtype).requires_grad_(False))
    config = LoRDBAConfig(rank=4, backend=backend)
    quantized = LoRDBALinear(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        quantized.scale_out.copy_(torch.rand(40, generator=gen) + 0.5)
        quantized.scale_rank.copy_(torch.rand(4, generator=gen) * 0.2)
    reference = LoRDBALinear(dequantized_linear(base).to(dtype), config)
    reference.load_state_dict(_adapter_state(quantized), strict=False)
    return quantized, reference


def _tolerance(dtype):
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


CASES = [
    ("torchao_int8", torch.float32),
    ("torchao_fp8", torch.bfloat16),
    ("loka_fp8", torch.float32),
]
CASES += [("loka_fp8", torch.bfloat16)]


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_inference_over_quantized_base_matches_dequantized(kind, dtype):
    quantized, reference = _pair(QUANTIZERS[kind], dtype)
    quantized.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(3, 5, 48, dtype=dtype)
    assert plain_weight(quantized.base) is None and not quantized._addmm_ok(x[0])
    assert reference._addmm_ok(x[0])  # the dequantized copy keeps the fused addmm path
    with torch.no_grad():
        out = quantized(x)
        expected = reference(x)
    assert out.dtype == dtype and out.shape == (3, 5, 40)
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    # And the adapter really contributes: the update is not lost in the base's rounding.
    assert (out - quantized.base(x)).abs().max() > 0.05


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_training_over_quantized_base_matches_dequantized(kind, dtype):
    quantized, reference = _pair(QUANTIZERS[kind], dtype)
    weight_before = dequantized_weight(quantized.base).clone()
    x = torch.randn(6, 48, dtype=dtype)
    x_q, x_r = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    weights = torch.randn(6, 40, dtype=dtype)
    (quantized(x_q) * weights).float().sum().backward()
    (reference(x_r) * weights).float().sum().backward()
    tol = _tolerance(dtype)
    torch.testing.assert_close(x_q.grad, x_r.grad, **tol)
    trained = [n for n, p in quantized.named_parameters() if p.requires_grad]
    assert trained == ["latent_a", "latent_b", "scale_rank", "scale_out"]
    params_r = dict(reference.named_parameters())
    for name in trained:
        grad, expected = quantized.get_parameter(name).grad, params_r[name].grad
        scale = expected.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(grad / scale, expected / scale, **tol, msg=name)
    # The base is frozen: no gradients, no parameter that trains, bytes unchanged.
    assert not any(p.requires_grad for p in quantized.base.parameters())
    torch.testing.assert_close(dequantized_weight(quantized.base), weight_before, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["torchao_int8", "loka_fp8"])
def test_triton_kernels_over_quantized_base(kind):
    quantized, reference = _pair(QUANTIZERS[kind], torch.float32, backend="triton")
    x = torch.randn(9, 48)
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), reference(x), atol=1e-3, rtol=1e-3)


def test_convert_train_save_load_over_fp8_and_int8_bases(tmp_path):
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)
    )
    model.requires_grad_(False)
    target = model[4].weight.detach().clone()
    quantize_fp8_weights(model, module_filter_fn=lambda _, name: name in ("0", "2"))
    _torchao_int8(model[4])
    assert isinstance(model[0], Fp8WeightOnlyLinear) and plain_weight(model[4]) is None
    model = convert_to_lordba(model, LoRDBAConfig(rank=4, backend="torch"))
    assert all(isinstance(model[i], LoRDBALinear) for i in (0, 2, 4))
    x = torch.randn(128, 32)
    y = (x @ torch.randn(32, 8)) * 0.3 + model(x).detach()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    first = None
    for _ in range(40):
        loss = nn.functional.mse_loss(model(x), y)
        first = first if first is not None else float(loss.detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.8 * first
    torch.testing.assert_close(dequantized_weight(model[4].base), target, atol=0.02, rtol=0.02)
    path = tmp_path / "adapter.safetensors"
    save_lordba(model, path)
    with torch.no_grad():
        before = model(x)
        restored = load_lordba(model, path)
        torch.testing.assert_close(restored(x), before, atol=1e-2, rtol=1e-2)


def test_fp8_weight_only_linear_survives_dtype_moves_and_refuses_quantized_input():
    torch.manual_seed(5)
    linear = nn.Linear(16, 24)
    fp8 = Fp8WeightOnlyLinear.from_linear(linear)
    codes = fp8.weight_fp8.clone()
    fp8.to(torch.bfloat16)
    assert torch.equal(fp8.weight_fp8, codes)  # .to(dtype) leaves the FP8 codes alone
    relative = (fp8.dequantize(torch.float32) - linear.weight).norm() / linear.weight.norm()
    assert 0 < relative < 0.05
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert fp8(x).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="plain float weight"):
        Fp8WeightOnlyLinear.from_linear(_torchao_int8(nn.Linear(16, 8)))


def test_mods_fp8_linear_as_base():
    """loka.mods.Fp8Linear (activations quantized too) runs through its own forward."""
    from loka.mods import Fp8Linear

    torch.manual_seed(6)
    base = Fp8Linear.from_linear(nn.Linear(32, 32).requires_grad_(False))
    model = convert_to_lordba(nn.Sequential(base), LoRDBAConfig(rank=4, backend="torch"))
    module = model[0]
    with torch.no_grad():
        module.scale_out.fill_(0.3)
    x = torch.randn(16, 32)
    with torch.no_grad():
        torch.testing.assert_close(module(x), base(x) + x @ module.delta_weight().T)
    module(x).square().sum().backward()
    assert module.latent_a.grad is not None and module.scale_out.grad.abs().sum() > 0
