"""Probe finds the norm that feeds each site alone and writes it into `sites.norm`."""

from __future__ import annotations

import polars as pl
import torch
from torch import nn

from loka.probe import Probe, ProbeConfig


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)  # feeds fc1 alone: fusable
        self.fc1 = nn.Linear(16, 32)
        self.rms = nn.RMSNorm(32)  # feeds q and k: not one site's
        self.q = nn.Linear(32, 8)
        self.k = nn.Linear(32, 8)
        self.ln2 = nn.LayerNorm(8)  # feeds out on one call of two
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rms(self.fc1(self.ln(x)))
        a = self.q(h) * self.k(h)
        return self.out(self.ln2(a)) + self.out(a)


def _probed_sites(model: nn.Module) -> pl.DataFrame:
    """The sites table after two training steps, every site sampled on each."""
    torch.manual_seed(0)
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, queue_size=4)
    with Probe(model, config) as probe:
        for _ in range(2):
            model(torch.randn(64, 16)).sum().backward()
            probe.step()
        return probe.tables()["sites"]


def test_the_norm_feeding_a_site_alone_is_in_the_sites_table() -> None:
    model = Block()
    sites = _probed_sites(model)
    norms = dict(zip(sites["site"], sites["norm"], strict=True))
    assert norms == {"fc1": "ln", "q": None, "k": None, "out": None}
    for name, module in model.named_modules():  # the trace's hooks are gone
        assert not module._forward_hooks and not module._forward_pre_hooks, name


class Producers(nn.Module):
    """Inputs computed by a norm, a functional activation through a view and a cast, a GEMM,
    a raw feature, and two different ops on two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(self.ln(x)))
        h = self.fc2(h.view(4, -1, 32).to(torch.float64).to(torch.float32).view(-1, 32))
        y = self.fc3(h)
        return self.shared(torch.relu(y)) + self.shared(torch.sigmoid(y))


def test_the_op_computing_each_site_input_is_in_the_sites_table() -> None:
    sites = _probed_sites(Producers())
    producers = dict(zip(sites["site"], sites["producer"], strict=True))
    assert producers == {
        "fc1": "native_layer_norm",  # the LayerNorm module, as autograd names its op
        "fc2": "gelu",  # F.gelu, seen through the views and casts
        "fc3": "addmm",  # another linear
        "shared": None,  # relu on one call, sigmoid on the other
    }


def test_an_input_that_needs_no_gradient_has_no_producer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, queue_size=4)
    with Probe(model, config) as probe, torch.no_grad():
        for _ in range(2):
            model(torch.randn(32, 8))
            probe.step()
        sites = probe.tables()["sites"]
    assert sites["producer"].to_list() == [None, None]


class GradProducers(nn.Module):
    """Outputs whose gradients come from GELU's backward, through a residual add from a
    LayerNorm's and the residual's sum, from another linear alone, and the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.ln = nn.LayerNorm(16)
        self.fc3 = nn.Linear(16, 16)
        self.fc4 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))  # fc1 -> gelu; fc2 -> add
        h = h + self.fc3(self.ln(h))  # h feeds ln and the residual: fc2's gradient is a sum
        return self.head(self.fc4(h.view(2, -1, 16).view(-1, 16)))  # fc4 -> head alone


def test_the_op_computing_each_site_output_gradient_is_in_the_sites_table() -> None:
    sites = _probed_sites(GradProducers())
    grad = dict(zip(sites["site"], sites["grad_producer"], strict=True))
    assert grad == {
        "fc1": "gelu",
        "fc2": "add",  # through its residual add: LayerNorm's and the residual's gradients
        "fc3": "addmm",  # through the second residual add and the views: fc4's dgrad alone
        "fc4": "addmm",  # the head's dgrad GEMM alone
        "head": None,  # the model's output: its gradient comes from outside the model
    }
