import pytest
import torch

from loka.kernels import quantize_transpose
from loka.kernels.testing import activation_like as make
from loka.kernels.testing import assert_same_fp8 as assert_same_quantization
from loka.kernels.transpose_quantization import quantize_transpose_reference
from loka.schema import QuantConfig

CONFIGS = [
    QuantConfig("e4m3", "tensor"),
    QuantConfig("e5m2", "row"),
    QuantConfig("e4m3", "row", pow2=True),
    QuantConfig("e4m3", "block", (1, 128)),
    QuantConfig("e5m2", "block", (128, 128), scale_ub=1e4),
]


@pytest.mark.parametrize("shape", [(1, 16), (70, 33), (130, 200)])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.fmt}-{c.granularity}-{c.block}")
def test_both_outputs_match_the_reference(shape, config):
    x = make(shape, torch.float32)
    q, qt = quantize_transpose(
        x,
        config.fmt,
        config.granularity,
        block=config.block,
        pow2=config.pow2,
        scale_ub=config.scale_ub,
    )
    want_q, want_qt = quantize_transpose_reference(x, config)
    assert q.shape == shape and qt.shape == shape[::-1]
    assert_same_quantization(q, want_q)
    assert_same_quantization(qt, want_qt)


def test_delayed_tensor_amax_and_nan():
    x = make((40, 24), torch.bfloat16, seed=2)
    x[3, 4] = float("nan")
    hist = torch.tensor([5.0])
    q, qt = quantize_transpose(x, "e4m3", "tensor", amax=hist)
    want_q, want_qt = quantize_transpose_reference(x, QuantConfig("e4m3", "tensor"), hist)
    assert_same_quantization(q, want_q)
    assert_same_quantization(qt, want_qt)
    assert torch.isnan(qt.data[4, 3].float())


def test_amax_with_row_granularity_is_refused():
    with pytest.raises(ValueError, match="granularity 'tensor' only"):
        quantize_transpose(torch.ones(4, 4), "e4m3", "row", amax=torch.ones(4))
