"""With FP8 on, an Fp8Linear's error is what Probe predicted for its recipe at that site;
Probe profiles a model after mods (fused and grouped sites included)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import Fp8Linear, Fp8LinearConfig, ModSpec, apply
from loka.mods.grouped import GroupedLinear
from loka.mods.norm_linear import NormLinear
from loka.zoo.layers import PerFeatureProjections

probe = pytest.importorskip("loka.probe", reason="Probe's predictions need loka-probe")
gemm_error = pytest.importorskip("loka.probe.gemm_error")

FWD = ("e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic")
DGRAD = ("e5m2:e4m3/tensor/dynamic", "e4m3:e4m3/row/dynamic")


def balanced_error(out, a, b):
    """Probe's statistic: the relative error with every entry weighed by 1/(|a_i| |b_j|)."""
    ref = a.double() @ b.double().T
    sums = gemm_error.error_sums(out.detach(), ref, gemm_error.balance_weights(a, b))
    return float((sums[0] / sums[1]).sqrt())


def test_fp8_linear_errors_match_probe_predictions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 64, generator=g) * torch.logspace(-1, 1, 64) for _ in range(6)]
    config = probe.ProbeConfig(
        every=1, warmup_steps=0, rows=64, recipes={"fwd": FWD, "dgrad": DGRAD, "wgrad": ()},
        real_fp8=False, timing=False,
    )  # fmt: skip
    grads = []  # dY of the first linear, per batch (the model does not change: no step)

    def keep_grad(module, args, out):
        out.register_hook(grads.append)

    model[0].register_forward_hook(keep_grad)
    with probe.Probe(model, config) as p:
        for x in batches:
            model(x).square().mean().backward()
            model.zero_grad()
            p.step()
        table = p.tables()["site_errors"]
    predicted = {
        (row["recipe"], row["pass"]): row
        for row in table.filter(table["site"] == "0").iter_rows(named=True)
    }
    linear = model[0]
    w = linear.weight.detach()
    for pass_, recipes in (("fwd", FWD), ("dgrad", DGRAD)):
        for recipe in recipes:
            passes = {"fwd": "bf16", "dgrad": "bf16", "wgrad": "bf16", pass_: recipe}
            module = Fp8Linear.from_linear(linear, Fp8LinearConfig(**passes))
            errors = []
            for x, dy in zip(batches, grads, strict=True):
                xg = x.clone().requires_grad_(True)
                y = module(xg)
                if pass_ == "fwd":
                    errors.append(balanced_error(y - linear.bias, x, w))
                else:
                    (dx,) = torch.autograd.grad(y, xg, dy)
                    errors.append(balanced_error(dx, dy, w.T))
            ours = sum(errors) / len(errors)
            row = predicted[(recipe, pass_)]
            # Same quantization on the same batches: agreement up to which batches Probe
            # sampled (it measured row["n"] of the 6), far inside FP8's own error.
            assert abs(ours - row["mean_rel_err"]) <= 0.05 * row["mean_rel_err"], (pass_, recipe)
            assert 0.01 < ours < 0.1


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = PerFeatureProjections(4, 16, 16)
        self.norm, self.fc = nn.LayerNorm(64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc(self.norm(self.features(x).flatten(1)))


def test_probe_profiles_a_model_after_mods():
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(32, 4, 16)
    apply(model, ModSpec(auto_fuse=True, auto_group=True), x)
    assert isinstance(model.features, GroupedLinear) and isinstance(model.fc, NormLinear)
    config = probe.ProbeConfig(
        every=1, warmup_steps=0, rows=32, recipes={"fwd": FWD[:1], "dgrad": (), "wgrad": ()},
        real_fp8=False, timing=False,
    )  # fmt: skip
    with probe.Probe(model, config) as p:
        for _ in range(2):
            model(x).square().mean().backward()
            p.step()
        tables = p.tables()
        assert p.errors == []
    kinds = dict(tables["sites"].select(["site", "kind"]).iter_rows())
    assert kinds == {"features": "grouped", "fc": "linear"}
    errors = tables["site_errors"]
    assert errors.height == 2 and all(0.01 < e < 0.1 for e in errors["mean_rel_err"])
