"""Quantizing a sampled operand: loka.schema's reference, with the full tensor's amaxes.
(Bit-exactness against loka.stats and the kernels: tests/test_fp8_reference.py.)"""

from __future__ import annotations

import pytest
import torch

from loka.probe.quantize import quantize_operand
from loka.schema import FP8_MAX, QuantConfig
from loka.schema.fp8 import dequantize


def test_dynamic_scales_map_each_group_amax_to_the_format_max() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 300, generator=g) * torch.exp2(torch.randn(200, 1, generator=g) * 4)
    for granularity, groups in (
        ("tensor", x.abs().amax().reshape(1, 1)),
        ("row", x.abs().amax(1, keepdim=True)),
    ):
        _, s = quantize_operand(x, QuantConfig("e4m3", granularity))
        assert torch.allclose(groups * s, torch.tensor(FP8_MAX["e4m3"]))
    codes, s = quantize_operand(x, QuantConfig("e4m3", "block", (1, 128)))
    assert s.shape == x.shape
    # every 1x128 tile (the last one is 44 wide) holds a code at the max
    for start in (0, 128, 256):
        assert torch.all(codes.float().abs()[:, start : start + 128].amax(1) == 448.0)


def test_weight_blocks_are_128x128_with_partial_edges() -> None:
    w = torch.ones(300, 200)
    w[0, 0], w[299, 199], w[130, 5] = 8.0, 4.0, 2.0
    _, s = quantize_operand(w, QuantConfig("e4m3", "block", (128, 128)))
    amax = 448.0 / s
    assert amax[:128, :128].eq(8.0).all() and amax[256:, 128:].eq(4.0).all()
    assert amax[128:256, :128].eq(2.0).all() and amax[128:256, 128:].eq(1.0).all()


def test_the_full_tensors_amax_sets_the_scale_and_what_exceeds_it_saturates() -> None:
    x = torch.linspace(-4, 4, 101).reshape(1, -1)
    q, s = quantize_operand(x, QuantConfig("e4m3", "tensor"), tensor_amax=torch.tensor(2.0))
    assert dequantize(q, s).abs().max() == 2.0  # values beyond the stale amax saturate at it
    rows = torch.tensor([[1.0, -3.0], [0.5, 0.25]])
    _, s = quantize_operand(rows, QuantConfig("e5m2", "row"), row_amax=torch.tensor([6.0, 1.0]))
    assert s.flatten().tolist() == pytest.approx([FP8_MAX["e5m2"] / 6.0, FP8_MAX["e5m2"]])
    # the override applies to its own granularity only
    _, s = quantize_operand(rows, QuantConfig("e4m3", "row"), tensor_amax=torch.tensor(100.0))
    assert s.flatten().tolist() == pytest.approx([448.0 / 3.0, 448.0 / 0.5])
