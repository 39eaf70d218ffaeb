"""LoRDBALinear's fused inference path (the one-launch ``sign_adapter`` kernel) against its
two-kernel path, under TRITON_INTERPRET=1 (or on a GPU): plain float bases and quantized ones,
which path each case takes (``forward_path``), and the fallbacks (training, torch backend,
large ranks, ``fused=False``).

Stated tolerance (README, "When the fused path is taken"): float32 outputs agree to 1e-5
relative to the output's scale; bf16 outputs to one bf16 rounding of the output (2e-2)."""

import copy
import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from loka.lordba import Fp8WeightOnlyLinear, LoRDBAConfig, LoRDBALinear, convert_to_lordba
from loka.lordba.config import FUSED_MAX_RANK
from loka.lordba.testing import assert_close_scaled, kernels_runnable, trained_like

pytestmark = pytest.mark.skipif(
    not kernels_runnable(),
    reason="loka.lordba.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _torchao_int8(linear):
    quant = pytest.importorskip("torchao.quantization")
    quant.quantize_(linear, quant.Int8WeightOnlyConfig())
    return linear


def _torchao_fp8(linear):
    quant = pytest.importorskip("torchao.quantization")
    quant.quantize_(linear, quant.Float8WeightOnlyConfig())
    return linear


BASES = {
    "plain": lambda linear: linear,
    "torchao_int8": _torchao_int8,
    "torchao_fp8": _torchao_fp8,
    "loka_fp8": Fp8WeightOnlyLinear.from_linear,
}


def _unfused(module: LoRDBALinear) -> LoRDBALinear:
    """The same module (same base, same parameters) on the two-kernel path."""
    twin = copy.copy(module)
    twin.config = dataclasses.replace(module.config, fused=False)
    return twin


def _assert_close(actual, expected, dtype):
    assert_close_scaled(actual, expected, TOLERANCE[dtype])


def _module(kind, dtype, k=45, n=38, rank=5, input_scale=False, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(DEVICE, dtype).requires_grad_(False)
    config = LoRDBAConfig(rank=rank, input_scale=input_scale, scaling=0.7, backend="triton")
    return trained_like(LoRDBALinear(BASES[kind](linear), config), seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("input_scale", "bias"), [(False, True), (True, False)])
def test_fused_matches_unfused_over_a_plain_base(dtype, input_scale, bias):
    module = _module("plain", dtype, input_scale=input_scale, bias=bias)
    unfused = _unfused(module)
    x = torch.randn(3, 13, 45, device=DEVICE, dtype=dtype)  # 39 tokens: off every tile
    with torch.no_grad():
        assert module.forward_path(x) == "addmm_fused"
        assert unfused.forward_path(x) == "addmm"
        out, expected = module(x), unfused(x)
    assert out.dtype == dtype and out.shape == (3, 13, 38)
    _assert_close(out, expected, dtype)
    # The update is really there (not lost in the base's rounding).
    assert (out.float() - module.base(x).float()).abs().max() > 0.05


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("torchao_int8", torch.float32),
        ("torchao_fp8", torch.bfloat16),
        ("loka_fp8", torch.float32),
        ("loka_fp8", torch.bfloat16),
    ],
)
def test_fused_matches_unfused_over_a_quantized_base(kind, dtype):
    module = _module(kind, dtype, input_scale=True)
    unfused = _unfused(module)
    x = torch.randn(37, 45, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        assert module.forward_path(x) == "base_fused"
        assert unfused.forward_path(x) == "base"
        out, expected = module(x), unfused(x)
        base = module.base(x)
    assert out.dtype == base.dtype and out.shape == (37, 38)
    _assert_close(out, expected, dtype)
    assert (out.float() - base.float()).abs().max() > 0.05


def test_the_whole_model_takes_the_fused_path_at_inference_only():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 16))
    model[2] = Fp8WeightOnlyLinear.from_linear(model[2])
    model = convert_to_lordba(model.to(DEVICE), LoRDBAConfig(rank=4, backend="triton"))
    for index in (0, 2):
        trained_like(model[index], seed=index)
    x = torch.randn(10, 24, device=DEVICE)
    # Training: the autograd path (two kernels, the rank activations saved).
    assert [model[i].forward_path(x) for i in (0, 2)] == ["base", "base"]
    out = model(x)
    out.square().sum().backward()
    assert model[0].latent_a.grad is not None and model[2].scale_out.grad is not None
    with torch.no_grad():
        assert [model[i].forward_path(x) for i in (0, 2)] == ["addmm_fused", "base_fused"]
        inference = model(x)
        for index in (0, 2):
            model[index].config = dataclasses.replace(model[index].config, fused=False)
        assert [model[i].forward_path(x) for i in (0, 2)] == ["addmm", "base"]
        unfused = model(x)
    _assert_close(inference, unfused, torch.float32)
    _assert_close(inference, out.detach(), torch.float32)


def test_fallbacks_are_explicit():
    x = torch.randn(4, 45, device=DEVICE)
    module = _module("loka_fp8", torch.float32)
    with torch.no_grad():
        assert module.forward_path(x) == "base_fused"
        # The torch references have no fused op: the two-op path, on any device.
        module.config = dataclasses.replace(module.config, backend="torch")
        assert module.forward_path(x) == "base"
        module.config = dataclasses.replace(module.config, backend="triton", fused=False)
        assert module.forward_path(x) == "base"
    # A rank whose rank activations would not fit in registers keeps the two kernels.
    big = _module("plain", torch.float32, k=16, n=8, rank=FUSED_MAX_RANK + 1)
    small = _module("plain", torch.float32, k=16, n=8, rank=FUSED_MAX_RANK)
    with torch.no_grad():
        assert big.forward_path(x[:, :16]) == "addmm"
        assert small.forward_path(x[:, :16]) == "addmm_fused"
    # A gradient asked of the input alone is enough to leave the fused path.
    module.config = dataclasses.replace(module.config, fused=True)
    module.requires_grad_(False)
    assert module.forward_path(x) == "base_fused"
    assert module.forward_path(x.requires_grad_(True)) == "base"
    with pytest.raises(ValueError, match="fused must be a bool"):
        LoRDBAConfig(fused="yes")


def test_no_tokens_and_a_strided_input():
    module = _module("plain", torch.float32)
    with torch.no_grad():
        empty = module(torch.randn(0, 45, device=DEVICE))
        assert empty.shape == (0, 38)
        wide = torch.randn(45, 9, device=DEVICE).t()  # columns not of unit stride
        _assert_close(module(wide), _unfused(module)(wide.contiguous()), torch.float32)
