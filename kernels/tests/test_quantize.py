import pytest
import torch

from loka.kernels import quantize
from loka.kernels.quantization import quantize_reference
from loka.kernels.testing import activation_like as make
from loka.kernels.testing import assert_same_fp8 as assert_same_quantization
from loka.schema import FP8_MAX, QuantConfig

SHAPES = [(1, 16), (3, 200), (130, 16), (64, 257)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "granularity,block",
    [("tensor", None), ("row", None), ("block", (1, 128)), ("block", (128, 128))],
)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_matches_reference_bytes(shape, granularity, block, fmt):
    x = make(shape)
    got = quantize(x, fmt, granularity, block=block)
    assert_same_quantization(got, quantize_reference(x, QuantConfig(fmt, granularity, block)))


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_pow2_and_upper_bound(granularity):
    x = make((5, 300), torch.float32, seed=1)
    for kw in ({"pow2": True}, {"scale_ub": 3.0}, {"pow2": True, "scale_ub": 1000.0}):
        got = quantize(x, "e4m3", granularity, **kw)
        assert_same_quantization(got, quantize_reference(x, QuantConfig("e4m3", granularity, **kw)))
        if kw.get("pow2"):
            mantissa = got.scale.view(torch.int32) & 0x007FFFFF
            assert torch.all(mantissa == 0)
        if "scale_ub" in kw:
            assert torch.all(got.scale <= kw["scale_ub"])


def test_pow2_dequantization_is_exact_where_representable():
    # Every finite e4m3 value divided by 32: a power-of-two scale (32) maps them back exactly.
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    x = (grid[grid.isfinite()] / 32).reshape(2, -1)
    q = quantize(x, "e4m3", "row", pow2=True)
    assert torch.equal(q.scale, torch.tensor([32.0, 32.0]))
    torch.testing.assert_close(q.dequantize(), x, rtol=0, atol=0)


def test_all_zero_rows_get_scale_one():
    x = torch.zeros(4, 40, dtype=torch.bfloat16)
    x[2] = 1.0
    q = quantize(x, "e4m3", "row")
    assert torch.all(torch.isfinite(q.scale))
    assert q.scale[0].item() == 1.0 and q.scale[2].item() == 448.0
    assert torch.all(q.data[0].float() == 0)


def test_nan_and_inf_documented_behaviour():
    x = torch.ones(3, 32)
    x[0, 1] = float("nan")
    x[1, 2] = float("inf")
    x[1, 3] = -float("inf")
    x[1, 4] = 2.0
    for fmt in ("e4m3", "e5m2"):
        q = quantize(x, fmt, "row")
        assert_same_quantization(q, quantize_reference(x, QuantConfig(fmt, "row")))
        d = q.data.float()
        # NaN stays NaN, the rest of its row is quantized normally.
        assert torch.isnan(d[0, 1]) and torch.isfinite(d[0, 2:]).all() and q.amax[0] == 1
        # Inf becomes NaN (an overflow upstream stays visible) and does not enter the scale
        # (amax is 2, not inf); the row's other values are quantized normally.
        assert d[1, 2:4].isnan().all() and d[1, 4] == FP8_MAX[fmt] and q.amax[1] == 2
        assert torch.isfinite(q.scale).all()


def test_delayed_amax_sets_the_scale_and_saturates():
    x = torch.linspace(-4, 4, 64).reshape(2, 32)
    q = quantize(x, "e4m3", "tensor", amax=torch.tensor([2.0]))
    assert q.scale.item() == 224.0 and q.amax.item() == 4.0  # scale from history, amax measured
    assert q.data.float().abs().max() == 448  # values beyond the stale amax saturate
    assert_same_quantization(
        q, quantize_reference(x, QuantConfig("e4m3", "tensor"), torch.tensor([2.0]))
    )
    rows = quantize(x, "e5m2", "row", amax=torch.tensor([1.0, 8.0]))
    assert_same_quantization(
        rows, quantize_reference(x, QuantConfig("e5m2", "row"), torch.tensor([1.0, 8.0]))
    )


def test_long_rows_take_the_two_read_path():
    from loka.kernels import quantization as qmod

    x = make((2, 40000), torch.float32, seed=3)
    assert x.shape[1] > qmod.MAX_ROW_IN_REGISTERS
    assert_same_quantization(
        quantize(x, "e4m3", "row"), quantize_reference(x, QuantConfig("e4m3", "row"))
    )


def test_strided_input_is_read_in_place():
    x = make((48, 40), torch.float32, seed=4)
    xt = x.t()  # a non-contiguous view
    assert_same_quantization(
        quantize(xt, "e4m3", "row"), quantize_reference(xt.contiguous(), QuantConfig("e4m3", "row"))
    )


def test_empty_input():
    q = quantize(torch.empty(0, 32), "e4m3", "row")
    assert q.data.shape == (0, 32) and q.scale.shape == (0,)
    t = quantize(torch.empty(0, 32), "e4m3", "tensor")
    assert t.scale.item() == 1.0


@pytest.mark.parametrize(
    "call,err,match",
    [
        (lambda: quantize(torch.ones(4, 4, dtype=torch.int32)), TypeError, "bfloat16"),
        (lambda: quantize(torch.ones(4)), ValueError, "2-D"),
        (lambda: quantize(torch.ones(4, 4), "e3m4"), ValueError, "format"),
        (lambda: quantize(torch.ones(4, 4), granularity="col"), ValueError, "granularity"),
        (
            lambda: quantize(torch.ones(4, 4), granularity="block", block=(2, 2)),
            ValueError,
            "block",
        ),
        (lambda: quantize(torch.ones(4, 4), scale_ub=float("nan")), ValueError, "scale_ub"),
        (
            lambda: quantize(torch.ones(4, 4), granularity="row", amax=torch.ones(3)),
            ValueError,
            "amax",
        ),
        (lambda: quantize([[1.0]]), TypeError, "torch.Tensor"),
    ],
)
def test_bad_input_is_refused(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_repeated_calls_each_get_their_own_launch():
    # Launch plans are cached per shape, strides, dtype and alignment: a sequence mixing
    # them must give every call its own right answer.
    big = make((40, 300), torch.float32, seed=5)
    inputs = [big[:, :256], big[:, 1:257], big.t()[:256], big[:, :256].bfloat16(), big[:8, :256]]
    for granularity, block in (("tensor", None), ("row", None), ("block", (1, 128))):
        config = QuantConfig("e4m3", granularity, block)
        for x in inputs + inputs[::-1]:
            assert_same_quantization(quantize(x, "e4m3", granularity, block=block),
                                     quantize_reference(x.contiguous(), config))  # fmt: skip


@pytest.mark.parametrize(
    "granularity,block", [("tensor", None), ("row", None), ("block", (1, 128))]
)
def test_outputs_share_no_storage(granularity, block):
    # Custom ops built on quantize may not return outputs that alias one another.
    q = quantize(make((8, 256)), "e4m3", granularity, block=block)
    pointers = {t.untyped_storage().data_ptr() for t in (q.data, q.scale, q.inv_scale, q.amax)}
    assert len(pointers) == 4
