"""Probe finds the norm that feeds each site alone and writes it into `sites.norm`."""

from __future__ import annotations

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


def test_the_norm_feeding_a_site_alone_is_in_the_sites_table() -> None:
    torch.manual_seed(0)
    model = Block()
    config = ProbeConfig(every=1, warmup_steps=0, max_sites_per_step=None, queue_size=4)
    with Probe(model, config) as probe:
        for _ in range(2):
            model(torch.randn(64, 16)).sum().backward()
            probe.step()
        sites = probe.tables()["sites"]
    norms = dict(zip(sites["site"], sites["norm"], strict=True))
    assert norms == {"fc1": "ln", "q": None, "k": None, "out": None}
    for name, module in model.named_modules():  # the trace's hooks are gone
        assert not module._forward_hooks and not module._forward_pre_hooks, name
