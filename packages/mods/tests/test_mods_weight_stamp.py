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


def _fresh_output(module: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward of a new Fp8Linear over a copy of the module's current weights."""
    twin = nn.Linear(module.in_features, module.out_features)
    twin.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()})
    return Fp8Linear.from_linear(twin, Fp8LinearConfig()).forward(x)


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
