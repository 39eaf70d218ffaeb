"""Cached FP8 weights follow every optimizer step, fused ones included (torch's fused AdamW
updates parameters without moving their version counters)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import Fp8LinearConfig, apply
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.spec import ModSpec, SiteMods
from loka.mods.weight_stamp import invalidate_weight_caches


def _fresh_output(module: Fp8Linear, x: torch.Tensor, config=None) -> torch.Tensor:
    """The forward of a new Fp8Linear (`config`, default Fp8LinearConfig()) over a copy of
    the module's current weights."""
    twin = nn.Linear(module.in_features, module.out_features)
    twin.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()})
    return Fp8Linear.from_linear(twin, config or Fp8LinearConfig()).forward(x)


@pytest.mark.parametrize("optimizer", ["fused", "foreach", "single"])
def test_weight_cache_is_remade_after_each_optimizer_step(optimizer):
    torch.manual_seed(0)
    module = Fp8Linear.from_linear(nn.Linear(64, 32), Fp8LinearConfig())
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}
    opt = torch.optim.AdamW(module.parameters(), lr=0.05, **kw[optimizer])
    x = torch.randn(16, 64)
    for _ in range(2):
        version = module.weight._version
        module(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if optimizer == "fused":
            assert module.weight._version == version  # the case the stamp exists for
        assert torch.equal(module(x), _fresh_output(module, x))


def test_writes_through_data_need_an_explicit_invalidation():
    module = Fp8Linear.from_linear(nn.Linear(64, 32), Fp8LinearConfig())
    x = torch.randn(8, 64)
    before = module(x)
    module.weight.data.mul_(2.0)  # `.data` has its own version counter
    assert torch.equal(module(x), before)  # stale: nothing could see the write
    invalidate_weight_caches()
    assert torch.equal(module(x), _fresh_output(module, x))


def test_undo_after_fused_training_keeps_what_training_did():
    torch.manual_seed(1)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 32))
    with torch.no_grad():
        model[0].bias.normal_()
    x = torch.randn(8, 64)
    report = apply(model, ModSpec(sites={"1": SiteMods(fold_norm_bias=True)}), x)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model(x).sum().backward()
    opt.step()
    trained = model(x).detach()
    report.undo()  # must not restore the pre-training values the rewrite started from
    torch.testing.assert_close(model(x), trained, rtol=1e-5, atol=1e-5)


def test_frozen_weights_keep_their_fp8_copy_across_optimizer_steps():
    base = Fp8Linear.from_linear(nn.Linear(64, 32), Fp8LinearConfig())
    base.requires_grad_(False)
    head = nn.Linear(32, 4)
    opt = torch.optim.AdamW(head.parameters(), lr=0.05, fused=True)
    x = torch.randn(8, 64)
    head(base(x)).sum().backward()
    cached = base._weight_stamp
    opt.step()
    base(x)
    assert base._weight_stamp == cached  # no re-quantization of a weight no step can touch
    invalidate_weight_caches()
    base(x)
    assert base._weight_stamp != cached


def test_a_backward_pending_across_a_weight_refresh_uses_the_weight_of_its_forward():
    # Eager refreshes replace the cached FP8 copies instead of writing into them: a backward
    # still pending keeps the W^T its forward saved (an in-place refresh made autograd
    # refuse it: "modified by an inplace operation").
    row = "e4m3:e4m3/row/dynamic"
    config = Fp8LinearConfig.from_recipes(row, row, "bf16")
    torch.manual_seed(0)
    module = Fp8Linear(32, 16, config=config)
    twin = Fp8Linear(32, 16, config=config)
    twin.load_state_dict(module.state_dict())
    x = torch.randn(8, 32, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    first = module(x)
    twin(x_twin).sum().backward()
    with torch.no_grad():
        module.weight.mul_(3.0)
    second = module(x)
    first.sum().backward()
    assert torch.equal(x.grad, x_twin.grad)
    assert torch.equal(second, _fresh_output(module, x, config))
