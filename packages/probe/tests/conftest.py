"""Shared helpers: synthetic GEMM sites whose operands the test controls exactly."""

from __future__ import annotations

from collections.abc import Callable

import polars as pl
import pytest
import torch
from torch import nn

from loka.probe import Probe, ProbeConfig

Maker = Callable[[int, torch.Generator], torch.Tensor]


class Sites(nn.Module):
    """Independent linears, each fed its own input and given its own output gradient."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.lins = nn.ModuleDict({k: nn.Linear(i, o, bias=False) for k, (i, o) in shapes.items()})


def drive(
    model: Sites,
    inputs: dict[str, Maker],
    grads: dict[str, Maker],
    steps: int,
    config: ProbeConfig,
    seed: int = 0,
) -> dict[str, pl.DataFrame]:
    """Run `steps` steps with loss = sum(y * G) so that dY = G exactly; return the tables."""
    g = torch.Generator().manual_seed(seed)
    with Probe(model, config) as probe:
        for step in range(steps):
            loss = torch.zeros(())
            for name, lin in model.lins.items():
                y = lin(inputs[name](step, g))
                loss = loss + (y * grads[name](step, g)).sum()
            loss.backward()
            model.zero_grad(set_to_none=True)
            probe.step()
        tables = probe.tables()
        assert probe.errors == []
    return tables


def verdict(errors: pl.DataFrame, site: str, recipe: str, pass_: str) -> str:
    row = errors.filter(
        (pl.col("site") == site) & (pl.col("recipe") == recipe) & (pl.col("pass") == pass_)
    )
    assert len(row) == 1, f"no row for {site} {recipe} {pass_}"
    return row["verdict"][0]


@pytest.fixture
def every_step() -> ProbeConfig:
    """Sample every step and never drop one (a deep queue): deterministic CPU tests."""
    return ProbeConfig(every=1, warmup_steps=0, rows=128, min_batches=5, queue_size=64)


@pytest.fixture
def synthetic() -> tuple[type[Sites], Callable[..., dict[str, pl.DataFrame]], Callable[..., str]]:
    """(Sites, drive, verdict): test modules reach the helpers through this fixture."""
    return Sites, drive, verdict
