"""GroupedLinear: layouts read from a sample, bmm/loop/FP8 against the original container."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import copy

import pytest
import torch
from torch import nn

from loka.mods.config import Fp8LinearConfig
from loka.mods.grouped import (
    GroupedLinear,
    GroupingError,
    GroupLayout,
    detect_group_layout,
    group_candidates,
)
from loka.mods.reference import fp8_linear_reference
from loka.zoo.layers import PerFeatureProjections


class Heads(nn.Module):
    """Per-task heads over one shared input, concatenated."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(24, 8), nn.Linear(24, 8), nn.Linear(24, 8)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], dim=-1)


class Towers(nn.Module):
    """A list of inputs to a list of outputs (a ModuleDict of linears without biases)."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleDict({k: nn.Linear(16, 12, bias=False) for k in "pqrs"})

    def forward(self, xs):
        return [tower(x) for tower, x in zip(self.towers.values(), xs, strict=True)]


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


CASES = {
    "stacked": (
        lambda: PerFeatureProjections(6, 16, 12),
        lambda g: torch.randn(10, 6, 16, generator=g),
        GroupLayout("stacked", 1, "stacked", 1),
    ),
    "shared-concat": (
        Heads,
        lambda g: torch.randn(2, 5, 24, generator=g),
        GroupLayout("shared", 0, "concat", 0),
    ),
    "list": (
        Towers,
        lambda g: [torch.randn(7, 16, generator=g) for _ in range(4)],
        GroupLayout("list", 0, "list", 0),
    ),
}


def grads(model, x):
    out = model(x)
    leaves = out if isinstance(out, list) else [out]
    sum(leaf.square().sum() for leaf in leaves).backward()
    result = (
        [leaf.detach() for leaf in leaves],
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )
    model.zero_grad()
    return result


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["bmm", "loop"])
def test_layouts_are_detected_and_grouping_is_exact(case, backend):
    make, sample, layout = CASES[case]
    torch.manual_seed(0)
    model = Wrapper(make())
    x = sample(torch.Generator().manual_seed(1))
    assert group_candidates(model) == ["inner"]
    assert detect_group_layout(model, "inner", x) == layout
    want = grads(model, x)
    keys = model.state_dict().keys()
    original = model.inner
    model.inner = GroupedLinear(original, layout, backend=backend)
    assert model.state_dict().keys() == keys
    got = grads(model, x)
    for g, w in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-6)
    model.inner = model.inner.restore(original)
    assert model.state_dict().keys() == keys


def test_fp8_grouped_matches_per_group_emulation():
    torch.manual_seed(0)
    projections = PerFeatureProjections(3, 32, 16)
    config = Fp8LinearConfig("e4m3:e4m3/row/dynamic", "e5m2:e4m3/row/dynamic", "bf16")
    grouped = GroupedLinear(copy.deepcopy(projections), GroupLayout(), backend="fp8", config=config)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 3, 32, generator=g).requires_grad_(True)
    dy = torch.randn(12, 3, 16, generator=g)
    y = grouped(x)
    y.backward(dy)
    for i, linear in enumerate(grouped.linears):
        ref = fp8_linear_reference(x[:, i].detach(), linear.weight.detach(), config, dy[:, i])
        want_y = ref.y + linear.bias.detach()
        torch.testing.assert_close(y[:, i].detach(), want_y, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(
            x.grad[:, i], ref.dx, rtol=1e-2, atol=1e-2 * float(ref.dx.abs().max())
        )
        torch.testing.assert_close(linear.weight.grad, ref.dw, rtol=1e-4, atol=1e-5)  # bf16 pass
        torch.testing.assert_close(linear.bias.grad, dy[:, i].sum(0))


def test_probe_operands_of_a_group():
    torch.manual_seed(0)
    grouped = GroupedLinear(PerFeatureProjections(4, 8, 8), GroupLayout())
    x = torch.randn(5, 4, 8)
    out = grouped(x)
    entries = grouped.loka_gemm_operands((x,), out)
    assert len(entries) == 4 and grouped.loka_gemm_kind == "grouped"
    for i, entry in enumerate(entries):
        assert torch.equal(entry["input"], x[:, i])
        assert torch.equal(entry["grad"](out), out[:, i])


def test_refusals():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.a(x), self.b(x)

    with pytest.raises(GroupingError, match="differ in shape"):
        GroupedLinear(Mixed(), GroupLayout())

    class Scaled(PerFeatureProjections):
        def __init__(self):
            super().__init__(2, 8, 8)
            self.gain = nn.Parameter(torch.ones(1))

    with pytest.raises(GroupingError, match="parameters outside"):
        GroupedLinear(Scaled(), GroupLayout())

    class Residual(PerFeatureProjections):
        def forward(self, x):
            return super().forward(x) + x  # not just the linears' outputs

    model = Wrapper(Residual(3, 8, 8))
    with pytest.raises(GroupingError, match="outputs are not the groups"):
        detect_group_layout(model, "inner", torch.randn(4, 3, 8))
    with pytest.raises(GroupingError, match="rowwise dynamic"):
        GroupedLinear(
            PerFeatureProjections(2, 8, 8), GroupLayout(), backend="fp8",
            config=Fp8LinearConfig.from_recipes("e4m3:e4m3/tensor/dynamic"),
        )  # fmt: skip
