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


def _plateau(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Output gradients `[m, 256]` of a model on a loss plateau, and a weight `[256, 512]`:
    every token's gradient is its label's multiple of one shared direction, the multiples
    cancelling over the batch to 0.2% of a row, plus a 0.1% part (common to the tokens
    and their own) that holds much of what the sum over the batch keeps."""
    g = torch.Generator().manual_seed(seed)
    shared, common = torch.randn(2, 1, 256, generator=g)
    labels = (torch.rand(m, 1, generator=g) < 0.25).float()
    multiples = labels.mean() + 0.002 - labels
    dy = multiples * shared + 1e-3 * (common + torch.randn(m, 256, generator=g))
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(99)) / 16
    return dy.bfloat16(), w.bfloat16()


@pytest.fixture
def plateau_gradients() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`(m, seed=0) -> (dY, W)`: output gradients of a model on a loss plateau."""
    return _plateau


@pytest.fixture
def every_step() -> ProbeConfig:
    """Sample every step and never drop one (a deep queue): deterministic CPU tests."""
    return ProbeConfig(every=1, warmup_steps=0, rows=128, min_batches=5, queue_size=64)


@pytest.fixture
def synthetic() -> tuple[type[Sites], Callable[..., dict[str, pl.DataFrame]], Callable[..., str]]:
    """(Sites, drive, verdict): test modules reach the helpers through this fixture."""
    return Sites, drive, verdict
