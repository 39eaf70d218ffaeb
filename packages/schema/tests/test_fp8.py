"""The reference FP8 quantization on known answers (its agreement with every other
implementation: tests/test_fp8_reference.py)."""

import pytest
import torch

from loka.schema import FP8_MAX, QuantConfig, RecipeError
from loka.schema.fp8 import (
    dequantize,
    fp8_dtype,
    fp8_values,
    group_amax,
    quantize_reference,
    scale_from_amax,
)


def test_scale_rule() -> None:
    amax = torch.tensor([3.0, 0.0, float("inf"), float("nan"), 1e-30, 1e-3])
    s = scale_from_amax(amax, "e4m3")
    assert s[0] == torch.tensor(448.0) / 3.0
    assert s[1:4].tolist() == [1.0, 1.0, 1.0]  # nothing finite and positive: scale 1
    assert s[4] == torch.tensor(448.0) / 1e-12  # amax floored
    capped = scale_from_amax(amax, "e5m2", pow2=True, scale_ub=1000.0)
    assert capped[5] == 512.0  # min(57344 / 1e-3, 1000), rounded down to a power of two
    assert torch.equal(capped, torch.exp2(torch.log2(capped).floor()))


def test_quantize_keeps_nan_makes_inf_nan_and_ignores_both_in_amax() -> None:
    x = torch.tensor([[1.0, -2.0, float("inf"), float("nan")], [0.0, 0.0, 0.0, 0.0]])
    q, scale, amax = quantize_reference(x, QuantConfig("e4m3", "row"))
    assert amax.tolist() == [2.0, 0.0] and scale.tolist() == [224.0, 1.0]
    values = dequantize(q, scale.view(2, 1))
    assert values[0, :2].tolist() == [1.0, -2.0]
    # Inf is an overflow upstream: NaN, so that it is not hidden (a saturated Inf reached
    # the GEMM's output as a finite number); NaN stays NaN.
    assert values[0, 2:].isnan().all() and values[1].eq(0).all()
    # A finite value beyond the range (a stale delayed amax) still saturates.
    q, scale, _ = quantize_reference(torch.tensor([[1.0, 8.0]]), QuantConfig("e4m3", "row"),
                                     torch.tensor([1.0]))  # fmt: skip
    assert dequantize(q, scale.view(1, 1)).tolist() == [[1.0, FP8_MAX["e4m3"] / 448.0]]


def test_blocks_keep_to_the_values_that_exist() -> None:
    w = torch.ones(300, 200)
    w[0, 0], w[299, 199] = 8.0, 4.0
    amax = group_amax(w, "block", (128, 128))
    assert amax.shape == (3, 2) and amax[0, 0] == 8.0 and amax[2, 1] == 4.0 and amax[1, 1] == 1.0
    with pytest.raises(ValueError, match="scales' shape"):
        quantize_reference(w, QuantConfig("e4m3", "row"), torch.ones(3))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_lookup_table_decodes_as_torch_casts(fmt: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype(fmt))
    torch.testing.assert_close(fp8_values(codes), codes.double(), equal_nan=True, rtol=0, atol=0)
    with pytest.raises(RecipeError, match="FP8 format"):
        fp8_dtype("e3m4")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("options", [(False, None), (True, None), (False, 3.0)])
def test_scales_of_finite_amax_are_the_same_with_the_finite_shortcut(fmt, options):
    pow2, ub = options
    amax = torch.tensor([0.0, 1e-30, 3e-5, 0.5, 1.0, 448.0, 6e4, 3e38])
    want = scale_from_amax(amax, fmt, pow2, ub)
    got = scale_from_amax(amax, fmt, pow2, ub, finite=True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert want[0] == 1.0  # zero amax: the fallback scale either way


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_eager_scales_divide_by_a_host_scalar_with_the_bits_of_a_filled_tensor(fmt):
    # Eagerly the dividend is a CPU 0-dim tensor (no fill op per call); torch.compile traces
    # full_like. Both must be the one correctly rounded division, over the whole float range.
    from loka.schema.formats import AMAX_FLOOR

    g = torch.Generator().manual_seed(0)
    exps = torch.randint(-149, 128, (20000,), generator=g).double()
    amax = (torch.rand(20000, generator=g, dtype=torch.float64) * 2.0**exps).float()
    amax = torch.cat([amax, torch.tensor([0.0, AMAX_FLOOR, 1e-45, 3.4e38, float("inf")])])
    filled = torch.full_like(amax, FP8_MAX[fmt]) / amax.clamp_min(AMAX_FLOOR)
    want = torch.where((amax > 0) & (amax < float("inf")), filled, 1.0)
    got = scale_from_amax(amax, fmt)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    finite = amax[:-1]
    got = scale_from_amax(finite, fmt, finite=True)
    assert torch.equal(got.view(torch.int32), want[:-1].view(torch.int32))
