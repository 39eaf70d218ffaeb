"""The pure parts of bench/lordba_quality.py: low-bit LoRA factors, byte counts, matched ranks,
the LoRA wrapper (no data, no training run)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from loka.lordba import lordba_footprint

_BENCH = Path(__file__).resolve().parents[3] / "bench"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))  # the script imports bench/harness.py as `harness`
harness = importlib.import_module("harness")
bench = harness.load("lordba_quality")  # importing it runs nothing


def test_one_bit_rows_are_signs_times_mean_magnitude():
    weight = torch.randn(5, 33)
    q = bench.quantize_rows(weight, 1)
    scale = weight.abs().mean(dim=1, keepdim=True)
    torch.testing.assert_close(q.abs(), scale.expand_as(q))
    assert torch.equal(q < 0, weight < 0)
    # mean|w| is the L2-optimal scale for the sign pattern: nudging it only adds error.
    error = (weight - q).norm()
    for factor in (0.9, 1.1):
        assert (weight - q * factor).norm() > error


def test_more_bits_fewer_errors_and_levels_per_row():
    torch.manual_seed(0)
    weight = torch.randn(8, 256)
    errors = [float((bench.quantize_rows(weight, b) - weight).norm()) for b in (1, 2, 3, 4)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.15 * weight.norm()
    two_bit = bench.quantize_rows(weight, 2)
    assert all(len(row.unique()) <= 4 for row in two_bit)
    with pytest.raises(ValueError, match="bits must be >= 1"):
        bench.quantize_rows(weight, 0)


def test_byte_counts_and_matched_ranks():
    assert bench.lora_bytes(64, 192, 8, None) == 2 * 8 * (64 + 192)
    # A 1-bit LoRA with a per-row scale ships what LoRDBA (no q) ships: signs + r + N scales
    # (LoRDBA pads each packed row to a byte, so compare at multiples of 8).
    for k, n, r in [(64, 64, 8), (64, 192, 8), (4096, 4096, 16), (96, 40, 3)]:
        assert bench.lora_bytes(k, n, r, 1) == lordba_footprint(k, n, r).lordba_bytes
    shapes = [(64, 192), (64, 64), (64, 64), (64, 64)]
    budget = sum(lordba_footprint(k, n, 8).lordba_bytes for k, n in shapes)
    assert bench.matched_rank(shapes, budget, 1) == 8
    assert bench.matched_rank(shapes, budget, 2) == 4
    assert bench.matched_rank(shapes, budget, None) == 1


@pytest.mark.parametrize("bits", [None, 1, 2])
def test_lora_linear_starts_at_the_base_and_trains_through_the_quantizer(bits):
    torch.manual_seed(1)
    base = nn.Linear(16, 12)
    module = bench.LoRALinear(base, rank=4, alpha=8.0, bits=bits)
    x = torch.randn(6, 16)
    torch.testing.assert_close(module(x), base(x))  # B = 0
    module(x).square().sum().backward()
    assert module.lora_b.grad.abs().sum() > 0 and base.weight.grad is None
    with torch.no_grad():
        module.lora_b.normal_()
    a, b = module.factors()
    expected = base(x) + module.scaling * (x @ a.T) @ b.T
    torch.testing.assert_close(module(x), expected)
    if bits == 1:
        assert len(a[0].abs().unique()) == 1


def test_wrap_linears_and_quick_arguments():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    names = bench.wrap_linears(model, lambda m: bench.LoRALinear(m, 2, 2.0))
    assert names == ["0", "2.0"] and isinstance(model[2][0], bench.LoRALinear)
    args = bench.parse_args(["--quick"])
    assert (args.pretrain_steps, args.adapt_steps, args.eval_batches) == (40, 20, 8)
    assert bench.parse_args(["--adapt-steps", "7"]).adapt_steps == 7
