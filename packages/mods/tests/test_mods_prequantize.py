"""Serving with the weight quantized once (`Fp8Linear.prequantize_weight`): the same output
as quantizing it per call, bit for bit; a forward that would train the weight, or serve a
weight changed since, says so instead of computing with a stale copy; a compiled serving
graph quantizes only the input."""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import Fp8Linear, prequantize_weights, release_prequantized_weights
from loka.mods.config import Fp8LinearConfig

ROW, TENSOR = "e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic"


def serving_config(recipe: str, backend: str = "torch.native") -> Fp8LinearConfig:
    return Fp8LinearConfig.from_recipes(recipe, "bf16", "bf16", backend=backend)


@pytest.mark.parametrize("recipe", [ROW, TENSOR])
@pytest.mark.parametrize(
    ("shape", "backend"), [((64, 32), "torch.native"), ((50, 30), "torch.native.cpu")]
)
@pytest.mark.parametrize("autocast", [False, True])
def test_a_prequantized_forward_is_the_per_call_forward_bit_for_bit(
    recipe, shape, backend, autocast
):
    torch.manual_seed(0)
    module = Fp8Linear(*shape, config=serving_config(recipe, backend))
    x = torch.randn(24, shape[0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = module(x)
        assert module.prequantize_weight() and module.prequantized
        # A fixed address for CUDA graphs, as a buffer's (no copy-in per replay).
        assert all(hasattr(t, "_dynamo_static_input_type") for t in module._prequantized)
        got = module(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_training_a_prequantized_weight_is_refused_until_released():
    module = Fp8Linear(64, 32, config=serving_config(ROW))
    module.prequantize_weight()
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"prequantized for serving.*release_prequantized"):
        module(x)
    module.release_prequantized_weight()
    module(x).sum().backward()
    assert module.weight.grad is not None


def test_a_frozen_weight_still_passes_gradients_to_the_input():
    # A frozen base (LoRA): the input needs its gradient, the weight none. That forward
    # takes the per-call path, so the gradient is the usual one.
    module = Fp8Linear(64, 32, config=serving_config(ROW)).requires_grad_(False)
    reference = copy.deepcopy(module)
    module.prequantize_weight()
    x = torch.randn(8, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    module(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_a_weight_changed_since_is_refused_and_served_once_quantized_again():
    module = Fp8Linear(64, 32, config=serving_config(ROW)).requires_grad_(False)
    module.prequantize_weight()
    x = torch.randn(8, 64)
    with torch.no_grad():
        module.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="weight changed since prequantize_weight"):
            module(x)
        module.prequantize_weight()
        served = module(x)
        module.release_prequantized_weight()
        assert torch.equal(served, module(x))


def test_load_state_dict_and_to_quantize_the_new_weight_again():
    module = Fp8Linear(64, 32, config=serving_config(ROW)).requires_grad_(False)
    other = Fp8Linear(64, 32, config=serving_config(ROW)).requires_grad_(False)
    module.prequantize_weight()
    x = torch.randn(8, 64)
    with torch.no_grad():
        module.load_state_dict(other.state_dict())
        assert torch.equal(module(x), other(x))  # served from the loaded weight, no error
        module.to(torch.float64)
        assert module.prequantized and module._prequantized[0].dtype == torch.float8_e4m3fn
        module.release_prequantized_weight()
        unserved = module(x.double())
        module.prequantize_weight()
        assert torch.equal(module(x.double()), unserved)


def test_only_native_linears_with_an_fp8_forward_are_prequantized():
    model = nn.Sequential(
        Fp8Linear(64, 64, config=serving_config(ROW)),
        Fp8Linear(64, 64, config=Fp8LinearConfig.from_recipes("bf16", ROW, ROW, backend="torch.native")),
        Fp8Linear(64, 32, config=serving_config(ROW, backend="triton.fp8")),
        nn.Linear(32, 8),
    )  # fmt: skip
    assert prequantize_weights(model) == ["0"]
    assert release_prequantized_weights(model) == ["0"]
    assert not model[0].prequantized


def _graph_ops(model: nn.Module, x: torch.Tensor) -> list[str]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    (gm,) = graphs
    return [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes]


def test_a_compiled_serving_graph_quantizes_only_the_input():
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(64, 32, config=serving_config(TENSOR)))
    x = torch.randn(16, 64)
    per_call = _graph_ops(model, x)
    prequantize_weights(model)
    served = _graph_ops(model, x)

    # Every quantization takes one absolute maximum: two per call (x and W), one served.
    def reductions(ops):
        return [op for op in ops if "amax" in op or op == "max"]

    assert len(reductions(per_call)) == 2
    assert len(reductions(served)) == 1
    assert len(served) < len(per_call)


def test_inductor_serves_a_prequantized_model_as_it_serves_the_per_call_one():
    # Inductor fuses the norm with the input's quantization (so both differ from eager in
    # the last bits); with the weight prequantized the compiled output must not move at all.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(64), Fp8Linear(64, 32, config=serving_config(ROW))).eval()
    x = torch.randn(48, 64)
    with torch.no_grad():
        torch._dynamo.reset()
        per_call = torch.compile(model, fullgraph=True)(x)
        prequantize_weights(model)
        torch._dynamo.reset()
        served = torch.compile(model, fullgraph=True)(x)
    assert torch.equal(served, per_call)
