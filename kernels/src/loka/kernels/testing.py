"""Helpers for tests of code built on loka.kernels (used by this package's tests too)."""

from __future__ import annotations

import torch

from loka.kernels.fp8_tensor import Fp8Tensor


def assert_same_fp8(got: Fp8Tensor, want: Fp8Tensor) -> None:
    """Two quantizations are identical: metadata, float32 scales bit for bit, FP8 bytes
    byte for byte (NaN compared as NaN, whatever its sign bit)."""
    assert (got.fmt, got.granularity, got.block) == (want.fmt, want.granularity, want.block)
    for name in ("scale", "inv_scale", "amax"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    g, w = got.data.float().isnan(), want.data.float().isnan()
    assert torch.equal(g, w), "NaN positions differ"
    assert torch.equal(got.data.view(torch.uint8)[~g], want.data.view(torch.uint8)[~w])


def activation_like(shape: tuple[int, int], dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Normal values with row magnitudes spread over six decades, like real activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None]
    return x.to(dtype)
