"""NormLinear: the fused norm + FP8 linear against the unfused modules and the emulation."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.kernels.norm_quantization import norm_reference
from loka.mods.config import Fp8LinearConfig
from loka.mods.norm_linear import FusedNorm, FusionError, NormLinear, fuse_pair
from loka.mods.reference import fp8_linear_reference

ROW = "e4m3:e4m3/row/dynamic"


def pair(kind, seed=0, K=48, N=32):
    g = torch.Generator().manual_seed(seed)
    norm = nn.LayerNorm(K) if kind == "layernorm" else nn.RMSNorm(K)
    linear = nn.Linear(K, N)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(K, generator=g))
        if kind == "layernorm":
            norm.bias.copy_(0.3 * torch.randn(K, generator=g))
        linear.weight.copy_(torch.randn(N, K, generator=g) / K**0.5)
    x = 2 + 3 * torch.randn(20, K, generator=g)  # offset and spread: the norm matters
    dy = torch.randn(20, N, generator=g) * 1e-2
    return norm, linear, x, dy


def grads(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_bf16_fusion_is_exact(kind):
    norm, linear, x, dy = pair(kind)
    original = nn.Sequential(norm, linear)
    want = grads(original, x, dy)
    original.zero_grad()
    fused = nn.Sequential(*fuse_pair(norm, linear, Fp8LinearConfig.bf16()))
    assert fused.state_dict().keys() == original.state_dict().keys()
    assert [id(p) for p in fused.parameters()] == [id(p) for p in original.parameters()]
    got = grads(fused, x, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fp8_fusion_matches_emulation(kind):
    norm, linear, x, dy = pair(kind, seed=1)
    config = Fp8LinearConfig(ROW, "e5m2:e4m3/row/dynamic", ROW)
    fused = nn.Sequential(*fuse_pair(norm, linear, config))
    y, dx, g = grads(fused, x, dy)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    bias = getattr(norm, "bias", None)
    normed = norm_reference(
        x, norm.weight.detach(), None if bias is None else bias.detach(), eps, kind=kind
    )
    ref = fp8_linear_reference(normed, linear.weight.detach(), config, dy)
    torch.testing.assert_close(y, ref.y + linear.bias.detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(
        g["1.weight"], ref.dw, rtol=1e-2, atol=1e-2 * float(ref.dw.abs().max())
    )
    # dx and the norm's gradients: the FP8 dgrad (emulated) through the exact norm backward.
    xr = x.clone().requires_grad_(True)
    weight = norm.weight.detach().clone().requires_grad_(True)
    out = norm_reference(xr, weight, None if bias is None else bias.detach(), eps, kind=kind)
    out.backward(ref.dx)
    torch.testing.assert_close(dx, xr.grad, rtol=2e-2, atol=2e-2 * float(xr.grad.abs().max()))
    torch.testing.assert_close(
        g["0.weight"], weight.grad, rtol=2e-2, atol=2e-2 * float(weight.grad.abs().max())
    )
    exact = (normed @ linear.weight.detach().T).float()
    assert 1e-3 < float((y - linear.bias.detach() - exact).norm() / exact.norm()) < 0.06


def test_probe_sees_the_normalized_input():
    norm, linear, x, _ = pair("layernorm", seed=2)
    _, norm_linear = fuse_pair(norm, linear, Fp8LinearConfig())
    out = norm_linear(x)
    (entry,) = norm_linear.loka_gemm_operands((x,), out)
    torch.testing.assert_close(entry["input"], norm(x))
    assert entry["weight"] is linear.weight and entry["output"] is out


def test_unfuse_gives_back_equal_modules():
    norm, linear, x, _ = pair("rmsnorm", seed=3)
    _, norm_linear = fuse_pair(norm, linear, Fp8LinearConfig.bf16())
    new_norm, new_linear = norm_linear.unfused()
    assert type(new_norm) is nn.RMSNorm and type(new_linear) is nn.Linear
    assert new_norm.weight is norm.weight and new_linear.weight is linear.weight
    torch.testing.assert_close(new_linear(new_norm(x)), linear(norm(x)), rtol=0, atol=0)


def test_fusion_refusals():
    norm, linear, _, _ = pair("layernorm")
    with pytest.raises(FusionError, match="rowwise with dynamic"):
        fuse_pair(norm, linear, Fp8LinearConfig.from_recipes("e4m3:e4m3/tensor/dynamic"))
    with pytest.raises(FusionError, match="normalizes"):
        NormLinear.fuse(FusedNorm(nn.LayerNorm(16)), linear, Fp8LinearConfig.bf16())
    with pytest.raises(FusionError, match="last dim"):
        FusedNorm(nn.LayerNorm((4, 12)))
    with pytest.raises(FusionError, match=r"not an nn\.LayerNorm"):
        FusedNorm(nn.BatchNorm1d(48))
