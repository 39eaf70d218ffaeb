"""What the synthetic streams share: batch i is a pure function of (seed, split, i)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

Batch = dict[str, torch.Tensor]


class BatchStream:
    """Subclasses draw training batch i in `batch(i)` and held-out batch i in
    `eval_batch(i, split=...)`; held-out batches depend on the dataset, not on `seed`."""

    def __init__(
        self, config: Any, batch_size: int, *, device: torch.device | str = "cpu", seed: int = 0
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.config = config
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seed = seed

    def batch(self, index: int) -> Batch:
        raise NotImplementedError

    def eval_batch(self, index: int, *, split: str = "valid") -> Batch:
        raise NotImplementedError

    def train_batches(self) -> Iterator[Batch]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1

    def eval_batches(self, n: int = 4, *, split: str = "valid") -> list[Batch]:
        if n < 1:
            raise ValueError(f"n must be positive, got {n}")
        return [self.eval_batch(i, split=split) for i in range(n)]
