"""The base GEMM with LoRDBA's up-projection in its epilogue (``linear_sign_up``) under
TRITON_INTERPRET=1 (or on a GPU): against its pure-torch reference on awkward shapes, for
plain float weights and FP8 codes with per-channel scales; its base-only mode against the
bases' own forwards; and LoRDBALinear's ``gemm_epilogue`` path against the unfused one, with
``forward_path`` naming it where it applies and not elsewhere.

Stated tolerance (README, "The GEMM-epilogue path"): float32 to 1e-5 of the output's largest
magnitude, bf16/fp16 to 2e-2 (about one rounding of the output)."""

import copy
import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from loka.lordba import Fp8WeightOnlyLinear, LoRDBAConfig, LoRDBALinear
from loka.lordba.config import EPILOGUE_MAX_RANK
from loka.lordba.kernels import base_epilogue, pack_signs, sign_down
from loka.lordba.module import epilogue_base_forward
from loka.lordba.testing import OpaqueBase, assert_close_scaled, kernels_runnable, trained_like
from loka.schema import QuantConfig
from loka.schema.fp8 import quantize_reference

pytestmark = pytest.mark.skipif(
    not kernels_runnable(),
    reason="loka.lordba.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _assert_close(actual, expected, dtype):
    assert_close_scaled(actual, expected, TOLERANCE[dtype])


def _weight(kind, n, k, dtype, gen):
    """``(weight, weight_scale, fp8_format)`` of a random [n, k] weight stored as ``kind``."""
    weight = torch.randn(n, k, generator=gen) / k**0.5
    if kind == "plain":
        return weight.to(DEVICE, dtype), None, "e4m3"
    quantized = quantize_reference(weight, QuantConfig(fmt=kind, granularity="row"))
    scale = quantized.scale.reshape(-1).float().to(DEVICE)
    return quantized.data.view(torch.uint8).to(DEVICE), scale, kind


@pytest.mark.parametrize(
    ("m", "k", "n", "r", "dtype", "kind", "bias", "q"),
    [
        (37, 45, 70, 4, torch.float32, "plain", True, True),  # every axis off its tile and byte
        (37, 45, 70, 8, torch.bfloat16, "e4m3", True, False),
        (19, 70, 33, 16, torch.float16, "e5m2", False, True),
        (33, 64, 40, 16, torch.bfloat16, "plain", False, False),
        (20, 24, 17, 8, torch.float32, "e4m3", True, True),
    ],
)
def test_linear_sign_up_matches_reference(m, k, n, r, dtype, kind, bias, q):
    gen = torch.Generator().manual_seed(m + k + n + r)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    weight, weight_scale, fmt = _weight(kind, n, k, dtype, gen)
    in_scale = (torch.rand(k, generator=gen) + 0.5).to(DEVICE) if q else None
    packed_a = pack_signs(torch.randn(r, k, generator=gen)).to(DEVICE)
    options = {
        "weight_scale": weight_scale,
        "fp8_format": fmt,
        "bias": torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None,
    }
    adapter = {
        "rank_act": sign_down(x, packed_a, in_scale),  # t = (x q) sign(A)^T, float32
        "packed": pack_signs(torch.randn(r, n, generator=gen)).to(DEVICE),
        "rank_scale": (torch.rand(r, generator=gen) / k**0.5).to(DEVICE),
        "col_scale": (torch.rand(n, generator=gen) + 0.5).to(DEVICE),
        "alpha": 0.7,
    }
    for extra in ({}, adapter):  # base-only mode, then base + adapter
        out = base_epilogue.linear_sign_up(x, weight, **options, **extra)
        expected = base_epilogue.linear_sign_up_reference(x, weight, **options, **extra)
        assert out.dtype == dtype and out.shape == (m, n)
        _assert_close(out, expected, dtype)
    base_only = base_epilogue.linear_sign_up_reference(x, weight, **options)
    assert (out.float() - base_only.float()).abs().max() > 0.05  # the update is really there


def test_operand_checks():
    x = torch.randn(5, 16, device=DEVICE)
    codes = torch.zeros(8, 16, dtype=torch.uint8, device=DEVICE)
    run = base_epilogue.linear_sign_up_reference
    with pytest.raises(TypeError, match="x's dtype"):
        run(x, torch.randn(8, 16, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight_scale"):
        run(x, codes)
    with pytest.raises(ValueError, match="fp8_format"):
        run(x, codes, weight_scale=torch.ones(8, device=DEVICE), fp8_format="e3m4")
    with pytest.raises(ValueError, match=r"weight: expected shape \(N, 16\)"):
        run(x, torch.randn(8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="without rank_act"):
        run(x, torch.randn(8, 16, device=DEVICE), packed=pack_signs(torch.randn(2, 8)))
    with pytest.raises(ValueError, match="packed signs"):
        t = torch.randn(5, 2, device=DEVICE)
        run(x, torch.randn(8, 16, device=DEVICE), rank_act=t, packed=pack_signs(torch.randn(2, 9)))


def _base(kind, k, n, dtype, bias, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(DEVICE, dtype).requires_grad_(False)
    return linear if kind == "plain" else Fp8WeightOnlyLinear.from_linear(linear)


@pytest.mark.parametrize("kind", ["plain", "loka_fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_only_mode_is_the_bases_forward(kind, dtype):
    base = _base(kind, 45, 38, dtype, bias=True)
    x = torch.randn(3, 13, 45, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        out, expected = epilogue_base_forward(base, x), base(x)
    assert out.shape == expected.shape == (3, 13, 38) and out.dtype == expected.dtype
    _assert_close(out, expected, dtype)
    with pytest.raises(TypeError, match="no GEMM-epilogue form"):
        epilogue_base_forward(base, x.to(torch.float16) if kind == "plain" else x.long())


def _module(kind, dtype, k=45, n=38, rank=5, input_scale=False, bias=True):
    config = LoRDBAConfig(
        rank=rank, input_scale=input_scale, scaling=0.7, backend="triton", gemm_epilogue=True
    )
    return trained_like(LoRDBALinear(_base(kind, k, n, dtype, bias), config))


def _unfused(module: LoRDBALinear) -> LoRDBALinear:
    """The same module (same base, same parameters) on the two-kernel path."""
    twin = copy.copy(module)
    twin.config = dataclasses.replace(module.config, fused=False, gemm_epilogue=False)
    return twin


@pytest.mark.parametrize(
    ("kind", "dtype", "rank", "input_scale", "bias"),
    [
        ("plain", torch.bfloat16, 4, False, True),
        ("plain", torch.float16, 16, True, False),
        ("loka_fp8", torch.bfloat16, 8, True, True),
        ("loka_fp8", torch.float16, 16, False, False),
    ],
)
def test_epilogue_path_matches_unfused(kind, dtype, rank, input_scale, bias):
    module = _module(kind, dtype, rank=rank, input_scale=input_scale, bias=bias)
    unfused = _unfused(module)
    x = torch.randn(3, 13, 45, device=DEVICE, dtype=dtype)  # 39 tokens: off every tile
    with torch.no_grad():
        assert module.forward_path(x) == "gemm_epilogue"
        assert unfused.forward_path(x) == ("addmm" if kind == "plain" else "base")
        out, expected = module(x), unfused(x)
        base = module.base(x)
    assert out.dtype == dtype and out.shape == (3, 13, 38)
    _assert_close(out, expected, dtype)
    assert (out.float() - base.float()).abs().max() > 0.05  # the update is really there


def test_forward_path_names_the_epilogue_only_where_it_applies():
    x = torch.randn(4, 45, device=DEVICE, dtype=torch.bfloat16)
    module = _module("loka_fp8", torch.bfloat16)
    with torch.no_grad():
        assert module.forward_path(x) == "gemm_epilogue"
        # float32 inputs keep cuBLAS (the kernel's float32 GEMM is an IEEE, not a TF32, one).
        assert module.forward_path(x.float()) == "base_fused"
        # The torch references have no GEMM: the two-op path, on any device.
        module.config = dataclasses.replace(module.config, backend="torch")
        assert module.forward_path(x) == "base"
        module.config = dataclasses.replace(module.config, backend="triton", gemm_epilogue=False)
        assert module.forward_path(x) == "base_fused"
    # Training, or a gradient asked of the input alone: the autograd path.
    module.config = dataclasses.replace(module.config, gemm_epilogue=True)
    assert module.forward_path(x) == "base"
    module.requires_grad_(False)
    assert module.forward_path(x) == "gemm_epilogue"
    assert module.forward_path(x.clone().requires_grad_(True)) == "base"
    # "auto" takes the Triton kernels on CUDA only: CPU tensors keep the torch references.
    auto = _module("plain", torch.bfloat16)
    auto.config = dataclasses.replace(auto.config, backend="auto")
    with torch.no_grad():
        expected = "gemm_epilogue" if DEVICE == "cuda" else "addmm"
        assert auto.forward_path(x) == expected
        # Bases the kernel does not cover, a weight of another dtype, autocast, large ranks.
        opaque = copy.copy(module)
        opaque.base = OpaqueBase(_base("plain", 45, 38, torch.bfloat16, True))
        assert opaque.forward_path(x) == "base_fused"
        plain = _module("plain", torch.float32)
        assert plain.forward_path(x) == "base_fused"  # fp32 weight, bf16 input
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            assert _module("plain", torch.bfloat16).forward_path(x) == "base_fused"
        big = _module("plain", torch.bfloat16, k=16, n=8, rank=EPILOGUE_MAX_RANK + 1)
        small = _module("plain", torch.bfloat16, k=16, n=8, rank=EPILOGUE_MAX_RANK)
        assert big.forward_path(x[:, :16]) == "addmm"  # above FUSED_MAX_RANK too
        assert small.forward_path(x[:, :16]) == "gemm_epilogue"
    with pytest.raises(ValueError, match="gemm_epilogue must be a bool"):
        LoRDBAConfig(gemm_epilogue=1)
