"""Synthetic interaction sequences, and the padded/jagged batch layouts shared by all
sequential data.

Batch layouts (item id 0 is padding; ids run 1..num_items):
- padded training batch: `items` `[B, L]` left-padded (the most recent item is last),
  `targets` `[B, L]` the next item at each position, `negatives` `[N]` shared sampled items;
- jagged training batch: `items`, `targets` flat `[T]` (each sequence oldest first), and
  `offsets` `[B + 1]` where sequence b is `items[offsets[b]:offsets[b + 1]]`;
- evaluation batch: `items` `[B, L]` left-padded history, `candidates` `[B, C]` whose
  column 0 is the held-out next item and the rest sampled negatives.

A synthetic user likes two item clusters and drifts from the first to the second along
the sequence; items within a cluster follow a power law. The next item is thus predictable
from the history (which clusters, how far the drift has gone) beyond mere popularity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loka.zoo.data.seeding import (
    TRAIN_STREAM,
    generator,
    split_stream,
    stream_seed,
    to_device,
    zipf_ids,
)
from loka.zoo.data.stream import BatchStream

Layout = Literal["padded", "jagged"]
_SCRAMBLE_PRIME = 2654435761


def check_layout(layout: str) -> None:
    if layout not in ("padded", "jagged"):
        raise ValueError(f"layout must be 'padded' or 'jagged', got {layout!r}")


def training_batch(
    window: torch.Tensor, lengths: torch.Tensor, layout: Layout
) -> dict[str, torch.Tensor]:
    """Inputs and next-item targets from left-padded windows `[B, L + 1]`.

    `lengths` (on the host) counts the items of each window; a window of n items gives n - 1
    (input, target) pairs.
    """
    items, targets = window[:, :-1], window[:, 1:]
    if layout == "padded":
        return {"items": items.contiguous(), "targets": targets.contiguous()}
    check_layout(layout)
    batch, width = items.shape
    pairs = (lengths.cpu() - 1).clamp_min(0)
    total = int(pairs.sum())
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    torch.cumsum(pairs, 0, out=offsets[1:])
    device = window.device
    pairs_dev, offsets_dev = to_device(pairs, device), to_device(offsets, device)
    row = torch.repeat_interleave(torch.arange(batch, device=device), pairs_dev, output_size=total)
    position = torch.arange(total, device=device) - offsets_dev[row]
    column = width - pairs_dev[row] + position
    return {"items": items[row, column], "targets": targets[row, column], "offsets": offsets_dev}


@dataclass(frozen=True)
class ItemClusters:
    """How item ids are laid out: `num_clusters` interest clusters of `num_items //
    num_clusters` items each, power-law popular within a cluster, scrambled over the ids."""

    num_items: int
    num_clusters: int
    shift: int  # names the scramble; a dataset draws it from its teacher seed
    zipf_alpha: float

    def item_ids(self, cluster: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """Ids in 1..num_items of the items at `rank` within `cluster`."""
        raw = cluster + self.num_clusters * rank
        return 1 + (raw * _SCRAMBLE_PRIME + self.shift) % self.num_items

    def cluster_of(self) -> torch.Tensor:
        """`[num_items + 1]` the cluster of every id that `item_ids` can give (0 elsewhere)."""
        per_cluster = self.num_items // self.num_clusters
        raw = torch.arange(self.num_clusters * per_cluster)
        table = torch.zeros(self.num_items + 1, dtype=torch.int64)
        ids = self.item_ids(raw % self.num_clusters, raw // self.num_clusters)
        return table.index_copy_(0, ids, raw % self.num_clusters)


def drifting_items(
    clusters: ItemClusters,
    first: torch.Tensor,
    second: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    noise: float,
    g: torch.Generator,
) -> torch.Tensor:
    """Left-padded item sequences `[B, width]` (0 pads) of users who drift from cluster
    `first` to `second` (`[B, 1]` each) along their `lengths` (`[B, 1]`, on the device); with
    probability `noise` an item comes from a random cluster instead."""
    batch, dev = first.size(0), first.device
    from_end = torch.arange(width - 1, -1, -1, device=dev).view(1, -1)
    progress = 1.0 - from_end / (lengths - 1).clamp_min(1)
    drifted = torch.rand(batch, width, generator=g, device=dev) < progress
    cluster = torch.where(drifted, second, first)
    random_cluster = torch.randint(clusters.num_clusters, (batch, width), generator=g, device=dev)
    noisy = torch.rand(batch, width, generator=g, device=dev) < noise
    cluster = torch.where(noisy, random_cluster, cluster)
    per_cluster = clusters.num_items // clusters.num_clusters
    uniform = torch.rand(batch, width, generator=g, device=dev)
    items = clusters.item_ids(cluster, zipf_ids(uniform, per_cluster, clusters.zipf_alpha))
    return items.masked_fill(from_end >= lengths, 0)


@dataclass(frozen=True)
class SyntheticSequencesConfig:
    num_items: int = 1000
    max_seq_len: int = 16  # L: model input length (a sequence holds up to L + 1 items)
    layout: Layout = "padded"
    num_negatives: int = 64  # shared sampled negatives per training batch
    num_eval_negatives: int = 100
    num_clusters: int = 32
    min_len: int = 3
    zipf_alpha: float = 1.2
    noise: float = 0.1  # probability that an item comes from a random cluster
    teacher_seed: int = 0  # names the dataset; held-out batches depend only on it

    def __post_init__(self) -> None:
        check_layout(self.layout)
        for name in ("num_items", "max_seq_len", "num_negatives", "num_eval_negatives"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.num_clusters <= self.num_items:
            raise ValueError(f"num_clusters must be in [1, num_items], got {self.num_clusters}")
        if not 2 <= self.min_len <= self.max_seq_len + 1:
            raise ValueError(f"min_len must be in [2, max_seq_len + 1], got {self.min_len}")
        if self.zipf_alpha <= 0.0 or self.zipf_alpha == 1.0:
            raise ValueError(f"zipf_alpha must be positive and not 1, got {self.zipf_alpha}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {self.noise}")
        if self.num_items >= _SCRAMBLE_PRIME:
            raise ValueError(f"num_items {self.num_items} is too large")


class SyntheticSequences(BatchStream):
    """Infinite deterministic stream of sequential-recommendation batches on `device`."""

    def __init__(
        self,
        config: SyntheticSequencesConfig,
        batch_size: int,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        super().__init__(config, batch_size, device=device, seed=seed)
        self._shift = stream_seed(config.teacher_seed, 0, 0) % config.num_items

    def _windows(self, seed: int, stream: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded sequences `[B, L + 1]` and their lengths (on the host)."""
        cfg, batch, width = self.config, self.batch_size, self.config.max_seq_len + 1
        # Lengths come from a host generator so jagged layouts need no device sync.
        lengths = torch.randint(
            cfg.min_len,
            width + 1,
            (batch,),
            generator=generator(torch.device("cpu"), seed, stream, index),
        )
        g = generator(self.device, seed, stream, index)
        dev = self.device
        first, second = torch.randint(cfg.num_clusters, (2, batch, 1), generator=g, device=dev)
        items = drifting_items(
            ItemClusters(cfg.num_items, cfg.num_clusters, self._shift, cfg.zipf_alpha),
            first, second, to_device(lengths, dev).view(-1, 1), width, cfg.noise, g,
        )  # fmt: skip
        return items, lengths

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        window, lengths = self._windows(self.seed, TRAIN_STREAM, index)
        out = training_batch(window, lengths, self.config.layout)
        g = generator(self.device, self.seed, TRAIN_STREAM + 100, index)
        out["negatives"] = torch.randint(
            1,
            self.config.num_items + 1,
            (self.config.num_negatives,),
            generator=g,
            device=self.device,
        )
        return out

    def eval_batch(self, index: int, *, split: str = "valid") -> dict[str, torch.Tensor]:
        stream = split_stream(split)
        window, _ = self._windows(self.config.teacher_seed, stream, index)
        g = generator(self.device, self.config.teacher_seed, stream + 100, index)
        negatives = torch.randint(
            1,
            self.config.num_items + 1,
            (self.batch_size, self.config.num_eval_negatives),
            generator=g,
            device=self.device,
        )
        return {
            "items": window[:, :-1].contiguous(),
            "candidates": torch.cat([window[:, -1:], negatives], dim=1),
        }

    def item_counts(self, n: int = 16) -> torch.Tensor:
        """Item popularity `[num_items + 1]` counted over the first n training batches."""
        counts = torch.zeros(self.config.num_items + 1, device=self.device)
        for i in range(n):
            window, _ = self._windows(self.seed, TRAIN_STREAM, i)
            counts += torch.bincount(window.flatten(), minlength=counts.numel())
        counts[0] = 0
        return counts
