"""Outlier smoothing and norm-bias folding: outputs unchanged, FP8 error reduced."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods.config import Fp8LinearConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.smoothing import SmoothingError, fold_norm_bias, smooth, smoothing_factors
from loka.mods.trace import input_channel_amax


class Block(nn.Module):
    """A norm feeding two linears (like separate q and v projections)."""

    def __init__(self, width=64):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.v = nn.Linear(width, 32), nn.Linear(width, 48)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), self.v(h)


def outlier_block(seed=0):
    g = torch.Generator().manual_seed(seed)
    block = Block()
    with torch.no_grad():
        gain = torch.ones(64)
        # Outlier channels 1e5 above the rest: beyond e4m3's range within one scale group
        # (448 down to 2**-9), the other channels of a row flush to zero. Milder outliers
        # (60x-1e4x) cost FP8 nearly nothing: it is floating point.
        gain[[3, 17, 40]] = 1e5
        block.norm.weight.copy_(gain * (1 + 0.1 * torch.randn(64, generator=g)))
        block.norm.bias.copy_(0.5 * torch.randn(64, generator=g))
        for linear in (block.q, block.v):
            # Trained weights give outlier channels small weights: the output is not theirs.
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / 8 / gain)
    x = torch.randn(96, 64, generator=g)
    return block, x


def fp8_error(block, x):
    """Relative error of the q projection when it runs rowwise FP8 (fwd)."""
    h = block.norm(x)
    fp8 = Fp8Linear.from_linear(block.q, Fp8LinearConfig("e4m3:e4m3/row/dynamic", "bf16", "bf16"))
    with torch.no_grad():
        exact, got = block.q(h), fp8(h)
    return float((got - exact).norm() / exact.norm())


def test_smoothing_keeps_outputs_and_cuts_fp8_error():
    block, x = outlier_block()
    with torch.no_grad():
        before = block(x)
    error_before = fp8_error(block, x)
    amax = input_channel_amax(block, ["q"], [x])["q"]
    assert amax.shape == (64,) and float(amax[3]) > 1e4 * float(amax.median())
    factors = smooth(block.norm, [block.q, block.v], amax, alpha=0.5)
    with torch.no_grad():
        after = block(x)
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    smoothed = input_channel_amax(block, ["q"], [x])["q"]
    assert float(smoothed.max() / smoothed.median()) < 0.2 * float(amax.max() / amax.median())
    assert error_before > 0.1  # measured 0.15: rows lose their small channels
    assert fp8_error(block, x) < 0.05  # measured 0.033, FP8's usual error
    assert factors.shape == (64,) and bool((factors > 0).all())


def test_factors_are_balanced_and_safe():
    act = torch.tensor([4.0, 1.0, 0.0, float("inf")])
    weight = torch.tensor([[1.0, 4.0, 2.0, 1.0]])
    factors = smoothing_factors(act, [weight], alpha=0.5)
    torch.testing.assert_close(factors, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    with pytest.raises(SmoothingError, match="alpha"):
        smoothing_factors(act, [weight], alpha=1.5)


def test_bias_folding_is_exact_and_freezes_the_norm_bias():
    block, x = outlier_block(seed=1)
    with torch.no_grad():
        before = block(x)
    moved = fold_norm_bias(block.norm, [block.q, block.v])
    assert moved.abs().sum() > 0
    with torch.no_grad():
        after = block(x)
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not block.norm.bias.requires_grad and float(block.norm.bias.abs().sum()) == 0.0


def test_refusals():
    block, _ = outlier_block()
    block.q = nn.Linear(64, 32, bias=False)
    with pytest.raises(SmoothingError, match="no bias"):
        fold_norm_bias(block.norm, [block.q])
    with pytest.raises(SmoothingError, match="no affine weight"):
        smooth(nn.LayerNorm(64, elementwise_affine=False), [block.v], torch.ones(64))
    with pytest.raises(SmoothingError, match="takes 32 features"):
        smooth(block.norm, [nn.Linear(32, 8)], torch.ones(64))
