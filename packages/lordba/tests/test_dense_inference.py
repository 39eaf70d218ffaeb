"""LoRDBALinear's dense inference path (``LoRDBAConfig.dense_inference``): the adapter as two
GEMMs on dense factors made from the signs and scales, against the torch reference path, over
plain and quantized bases; which path each case takes; the factors' cache.

Stated tolerance (README, "The dense inference path"): float32 outputs agree with the
reference path to 1e-5 relative to the output's scale; bf16 outputs to 2e-2 (the rank
activations are rounded to bf16 between the two GEMMs)."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from loka.lordba import Fp8WeightOnlyLinear, LoRDBAConfig, LoRDBALinear
from loka.lordba.testing import assert_close_scaled, trained_like

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _torchao(config_name):
    def quantize(linear):
        quant = pytest.importorskip("torchao.quantization")
        quant.quantize_(linear, getattr(quant, config_name)())
        return linear

    return quantize


BASES = {
    "plain": lambda linear: linear,
    "torchao_int8": _torchao("Int8WeightOnlyConfig"),
    "torchao_fp8": _torchao("Float8WeightOnlyConfig"),
    "loka_fp8": Fp8WeightOnlyLinear.from_linear,
}


def _module(kind, dtype, input_scale=False, bias=True, seed=0, k=45, n=38, rank=5):
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    config = LoRDBAConfig(
        rank=rank, input_scale=input_scale, scaling=0.7, backend="torch", dense_inference=True
    )
    return trained_like(LoRDBALinear(BASES[kind](linear), config), seed)


def _reference(module: LoRDBALinear) -> LoRDBALinear:
    """The same module (same base, same parameters) on the torch reference path."""
    twin = copy.copy(module)
    twin.config = dataclasses.replace(module.config, dense_inference=False)
    return twin


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("plain", torch.float32),
        ("plain", torch.bfloat16),
        ("loka_fp8", torch.float32),
        ("loka_fp8", torch.bfloat16),
        ("torchao_int8", torch.float32),
        ("torchao_fp8", torch.bfloat16),
    ],
)
@pytest.mark.parametrize(("input_scale", "bias"), [(False, True), (True, False)])
def test_dense_matches_the_reference_path(kind, dtype, input_scale, bias):
    module = _module(kind, dtype, input_scale=input_scale, bias=bias)
    reference = _reference(module)
    x = torch.randn(3, 13, 45, dtype=dtype)
    with torch.no_grad():
        assert module.forward_path(x) == "dense"
        assert reference.forward_path(x) != "dense"
        out, expected = module(x), reference(x)
        base_only = module.base(x)
    assert out.dtype == dtype and out.shape == (3, 13, 38)
    assert_close_scaled(out, expected, TOLERANCE[dtype])
    # The adapter is there: the output is not the base's.
    assert (out.float() - base_only.float()).abs().max() > 10 * TOLERANCE[dtype] * out.abs().max()


def test_dense_factors_give_the_delta_weight():
    module = _module("plain", torch.float32, input_scale=True)
    right, left = module.dense_factors(torch.float32)
    assert right.shape == (5, 45) and left.shape == (38, 5)
    torch.testing.assert_close(left @ right, module.delta_weight(), rtol=1e-6, atol=1e-6)


def test_training_does_not_take_the_dense_path_and_trains():
    module = _module("plain", torch.float32)
    x = torch.randn(8, 45)
    assert module.forward_path(x) != "dense"  # parameters require grad
    module(x).square().sum().backward()
    assert module.latent_a.grad is not None and module.scale_out.grad is not None
    with torch.no_grad():
        assert module.forward_path(x) == "dense"


def test_dense_factors_follow_the_adapter():
    module = _module("plain", torch.float32)
    x = torch.randn(6, 45)
    with torch.no_grad():
        first = module(x)
        a, _ = module.dense_factors(torch.float32)
        assert module.dense_factors(torch.float32)[0] is a  # kept while nothing changed
        module.scale_out.mul_(2.0)
        module.latent_a[0].neg_()
        second = module(x)
        expected = _reference(module)(x)
    assert module.dense_factors(torch.float32)[0] is not a
    assert not torch.allclose(first, second)
    assert_close_scaled(second, expected, TOLERANCE[torch.float32])


def test_an_optimizer_step_remakes_the_factors():
    module = _module("plain", torch.float32)
    x = torch.randn(6, 45)
    optimizer = torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad], lr=0.1, fused=False
    )
    with torch.no_grad():
        module(x)
    module(x).square().sum().backward()
    optimizer.step()
    with torch.no_grad():
        out, expected = module(x), _reference(module)(x)
    assert_close_scaled(out, expected, TOLERANCE[torch.float32])


def test_dense_under_autocast_follows_the_base_dtype():
    module = _module("plain", torch.float32)
    x = torch.randn(4, 45)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert module.forward_path(x) == "dense"
        out, expected = module(x), _reference(module)(x)
    assert out.dtype == torch.bfloat16
    assert_close_scaled(out, expected, TOLERANCE[torch.bfloat16])


def test_config_refuses_dense_with_gemm_epilogue_and_non_bools():
    with pytest.raises(ValueError, match="choose one"):
        LoRDBAConfig(dense_inference=True, gemm_epilogue=True)
    with pytest.raises(ValueError, match="dense_inference must be a bool"):
        LoRDBAConfig(dense_inference=1)


class _KeepsItsOutput(nn.Module):
    """An opaque base that returns a buffer it keeps (as a static-output wrapper might)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear, self.in_features, self.out_features = linear, 45, 38
        self.kept: torch.Tensor | None = None

    def forward(self, x):
        self.kept = self.linear(x)
        return self.kept


def test_a_base_output_that_may_be_kept_is_not_written():
    torch.manual_seed(0)
    config = LoRDBAConfig(rank=5, scaling=0.7, backend="torch", dense_inference=True)
    opaque = trained_like(LoRDBALinear(_KeepsItsOutput(nn.Linear(45, 38)), config), 0)
    x = torch.randn(6, 45)
    with torch.no_grad():
        out = opaque(x)
        assert torch.equal(opaque.base.kept, opaque.base.linear(x))  # untouched
        assert_close_scaled(out, _reference(opaque)(x), TOLERANCE[torch.float32])


def test_the_dense_path_writes_into_a_linear_base_output_not_into_x():
    module = _module("plain", torch.float32)
    x = torch.randn(6, 45)
    before = x.clone()
    with torch.no_grad():
        out, expected = module(x), _reference(module)(x)
    assert torch.equal(x, before)
    assert_close_scaled(out, expected, TOLERANCE[torch.float32])


@pytest.mark.parametrize("kind", ["torchao_int8", "loka_fp8", "plain"])
def test_the_dense_path_accumulates_in_place_into_a_known_base_output(kind):
    """torchao's int8 linear returns a reshaped view of its GEMM's output: a view spanning
    its whole allocation is still fresh, so the adapter adds into it instead of copying."""
    module = _module(kind, torch.float32 if kind != "torchao_int8" else torch.bfloat16)
    x = torch.randn(2, 3, 45, dtype=torch.bfloat16 if kind == "torchao_int8" else torch.float32)
    with torch.no_grad():
        base_out = module.base(x)
        fresh = module._fresh_output(base_out, x)
        out = module(x)
        expected = _reference(module)(x)
    assert fresh
    assert_close_scaled(out, expected, TOLERANCE[out.dtype])

    def ops(fn):
        with torch.profiler.profile() as prof, torch.no_grad():
            fn(x)
        return [e.name for e in prof.events()]

    with_adapter, base_alone = ops(module), ops(module.base)
    assert with_adapter.count("aten::addmm_") == 1
    assert with_adapter.count("aten::addmm") == base_alone.count("aten::addmm")  # the base's own


def test_a_view_into_part_of_a_larger_buffer_is_not_written():
    module = _module("plain", torch.float32)
    x = torch.randn(6, 45)
    larger = torch.zeros(7, 38)
    assert not module._fresh_output(larger[1:], x)
    assert not module._fresh_output(larger[:, :38].t().contiguous().t(), x)
    assert module._fresh_output(larger.reshape(7, 2, 19), x)
    assert not module._fresh_output(larger.as_subclass(_Subclass), x)  # no storage to judge


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("kind", ["plain", "loka_fp8"])
def test_the_dense_path_compiles_whole_with_a_varying_token_count(kind):
    """Prefill is often compiled: no graph break (the factors' cache and the fresh-output
    check are eager-only) and no failure when the token count turns symbolic."""
    module = _module(kind, torch.float32)
    module.requires_grad_(False)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (10, 12, 15):
            x = torch.randn(2, tokens, 45)
            assert_close_scaled(compiled(x), module(x), TOLERANCE[torch.float32])
