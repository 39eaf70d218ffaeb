"""FP8 emulation in torch: bit-exact with loka.stats, scales per granularity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loka.probe.quantize import (
    FP8_MAX,
    OperandScaling,
    block_amax,
    dequantize,
    operand_scale,
    quantize,
    scale_from_amax,
)
from loka.stats import fp8_roundtrip


def _hard_values(n: int = 20000) -> torch.Tensor:
    """Normal values over many binades plus ties, subnormals, the max and beyond."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 12, (n,), generator=g).float())
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            448.0,
            -448.0,
            464.0,
            1e6,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-11,
            57344.0,
            61440.0,
            2.0**-16,
            2.0**-17,
        ]
    )
    return torch.cat([x, specials, 1.0 + torch.arange(64) / 128])  # ties of e4m3 and e5m2


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.375, 2.0**7])
def test_quantize_matches_loka_stats_bit_for_bit(fmt: str, scale: float) -> None:
    x = _hard_values()
    s = torch.tensor(scale)
    ours = dequantize(quantize(x, s, fmt), s).float().numpy()
    theirs = fp8_roundtrip(x.numpy(), fmt, scale)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_dynamic_scales_map_each_group_amax_to_the_format_max() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 300, generator=g) * torch.exp2(torch.randn(200, 1, generator=g) * 4)
    for granularity, groups in (
        ("tensor", x.abs().amax().reshape(1, 1)),
        ("row", x.abs().amax(1, keepdim=True)),
    ):
        s = operand_scale(x, OperandScaling("e4m3", granularity), weight=False)
        assert torch.allclose(groups * s, torch.tensor(448.0))
    s = operand_scale(x, OperandScaling("e4m3", "block"), weight=False)
    codes = quantize(x, s, "e4m3").float().abs()
    # every 1x128 tile (the last one is 44 wide) holds a code at the max
    for start in (0, 128, 256):
        assert torch.all(codes[:, start : start + 128].amax(1) == 448.0)


def test_weight_blocks_are_128x128_with_partial_edges() -> None:
    w = torch.ones(300, 200)
    w[0, 0], w[299, 199], w[130, 5] = 8.0, 4.0, 2.0
    amax = block_amax(w, weight=True)
    assert amax[:128, :128].eq(8.0).all() and amax[256:, 128:].eq(4.0).all()
    assert amax[128:256, :128].eq(2.0).all() and amax[128:256, 128:].eq(1.0).all()


def test_pow2_and_upper_bound() -> None:
    amax = torch.tensor([3.0, 0.01, 0.0, 1e-30])
    s = scale_from_amax(amax, "e4m3", pow2=True, scale_ub=2.0**20)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    assert torch.all(s * amax <= 448.0)
    assert s[2] == 1.0  # amax 0 gives scale 1
    assert s[3] <= 2.0**20  # capped
    dyn = scale_from_amax(amax, "e5m2")
    assert dyn[0] == pytest.approx(FP8_MAX["e5m2"] / 3.0)


def test_delayed_or_full_tensor_amax_saturates_what_exceeds_it() -> None:
    x = torch.linspace(-4, 4, 101)
    s = operand_scale(
        x.reshape(1, -1),
        OperandScaling("e4m3", "tensor"),
        weight=False,
        tensor_amax=torch.tensor(2.0),
    )
    back = dequantize(quantize(x, s.reshape(()), "e4m3"), s.reshape(()))
    assert back.abs().max() == 2.0  # values beyond the stale amax saturate at it
