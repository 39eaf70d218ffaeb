"""Static input scales for serving (`calibrate_input_scales`, `Fp8Linear.set_static_input_amax`):
the served forward quantizes its input with the calibrated scale, elementwise (no amax in
the compiled graph), saturating what lies beyond it; calibration is all or nothing."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import Fp8Linear, prequantize_weights, release_prequantized_weights
from loka.mods.config import Fp8LinearConfig
from loka.mods.native_function import quantized_weight_forward
from loka.mods.static_scales import calibrate_input_scales
from loka.schema.fp8 import saturate_cast, scale_from_amax

ROW, TENSOR = "e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic"


def served(recipe: str = ROW, shape=(64, 32)) -> Fp8Linear:
    config = Fp8LinearConfig.from_recipes(recipe, "bf16", "bf16", backend="torch.native")
    module = Fp8Linear(*shape, config=config).eval()
    module.prequantize_weight()
    return module


@pytest.mark.parametrize("recipe", [ROW, TENSOR])
def test_a_static_scale_quantizes_the_input_as_that_amax_says(recipe):
    torch.manual_seed(0)
    module = served(recipe)
    x = torch.randn(24, 64)
    x[3, 5] = 40.0  # beyond the amax below: saturates
    module.set_static_input_amax(8.0)
    assert module.static_input_amax == 8.0
    with torch.no_grad():
        got = module(x)
        # The same GEMM with the input quantized by hand with that scale.
        scale = scale_from_amax(torch.tensor(8.0), "e4m3")
        xq = saturate_cast(x, scale, "e4m3")
        assert xq.float()[3, 5] * (1 / scale) == 448 / scale  # saturated, not 40
        want = quantized_weight_forward(x, *module._prequantized, module.bias,
                                        module.native_plan.fwd, torch.float32, 32,
                                        input_scale=(scale, scale.reciprocal()))  # fmt: skip
    assert torch.equal(got, want)
    module.set_static_input_amax(None)
    with torch.no_grad():
        assert not torch.equal(module(x), got)  # dynamic scales again


def test_a_static_scale_needs_a_prequantized_weight_and_a_finite_amax():
    module = served()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"):
            module.set_static_input_amax(bad)
    module.set_static_input_amax(4.0)
    module.release_prequantized_weight()  # drops the static scale with the weight copy
    assert module.static_input_amax is None
    with pytest.raises(ValueError, match="call prequantize_weight"):
        module.set_static_input_amax(4.0)


def test_calibration_sets_each_linear_from_its_largest_input_times_the_margin():
    torch.manual_seed(1)
    model = nn.Sequential(served(ROW, (16, 32)), nn.GELU(), served(TENSOR, (32, 8)))
    batches = [torch.randn(10, 16) * s for s in (1.0, 3.0, 2.0)]
    with torch.no_grad():
        hidden = [nn.functional.gelu(model[0](b)) for b in batches]
    got = calibrate_input_scales(model, batches, margin=2.0)
    want_first = max(b.abs().max().item() for b in batches) * 2
    want_second = max(h.abs().max().item() for h in hidden) * 2
    assert got == pytest.approx({"0": want_first, "2": want_second})
    assert model[0].static_input_amax == pytest.approx(want_first)
    # Calibrated scales are close to the dynamic ones on data like the calibration's.
    x = torch.randn(10, 16) * 2
    with torch.no_grad():
        static = model(x)
        release_prequantized_weights(model)
        prequantize_weights(model)
        dynamic = model(x)
    assert (static - dynamic).norm() / dynamic.norm() < 0.1


def test_failed_calibration_keeps_the_scales_it_found():
    model = nn.Sequential(served(ROW, (16, 32)), nn.ReLU(), served(ROW, (32, 8)))
    calibrate_input_scales(model, [torch.randn(4, 16)])
    before = [m.static_input_amax for m in (model[0], model[2])]
    # Only zeros (and NaN, which amax ignores) reach the first linear.
    nothing = torch.zeros(4, 16)
    nothing[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"no finite non-zero input reached 0 during calibration"):
        calibrate_input_scales(model, [nothing])
    assert [m.static_input_amax for m in (model[0], model[2])] == before
    with pytest.raises(ValueError, match="no prequantized FP8 linear"):
        calibrate_input_scales(nn.Sequential(nn.Linear(4, 4)), [torch.randn(2, 4)])
    with pytest.raises(ValueError, match="margin must be"):
        calibrate_input_scales(model, [torch.randn(4, 16)], margin=0.5)


def test_compiled_static_serving_has_no_amax_reduction_and_matches_eager():
    torch.manual_seed(2)
    model = nn.Sequential(nn.GELU(), served(ROW)).eval()
    x = torch.randn(48, 64)
    calibrate_input_scales(model, [x])
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm

    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=capture, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    assert not any("amax" in t for t in targets), targets


def test_a_static_scale_follows_the_module_to_another_dtype_or_device():
    module = served()
    module.set_static_input_amax(6.0)
    module.to(torch.float64).to(torch.float32)
    assert module.static_input_amax == 6.0 and module.prequantized
