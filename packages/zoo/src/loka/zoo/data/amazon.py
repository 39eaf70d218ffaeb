"""The Amazon 5-core review sequences (Beauty, Sports_and_Outdoors) for sequential
recommendation: loading, the leave-one-out split, negative sampling and batches.

Each line of a file is `user item item ...` in chronological order, item ids 1..num_items.
Leave-one-out: per user, the last item is the test target, the one before it the
validation target, and everything before that is training data. Evaluation ranks the target
among sampled negatives that the user never interacted with (100 by default, uniform or by
popularity, seeded), as in SASRec.

The data folder is `data_dir` if given, else `$LOKA_DATA_DIR` (the `amazon-5core` folder
itself or a folder holding it), else `<repository>/../shared/data/amazon-5core`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from loka.zoo.data.seeding import split_stream, stream_seed
from loka.zoo.data.sequences import Layout, check_layout, training_batch

__all__ = [
    "AmazonSequences",
    "AmazonStream",
    "NegativeSampling",
    "dataset_path",
    "default_data_dir",
    "eval_negatives",
    "is_available",
    "item_counts",
    "left_padded",
    "load_amazon",
    "parse_sequences",
    "sample_items",
    "split_prefix",
    "split_targets",
]

FILES = {"beauty": "Beauty.txt", "sports": "Sports_and_Outdoors.txt"}
NegativeSampling = Literal["uniform", "popularity"]
_FOLDER = "amazon-5core"


def default_data_dir() -> Path:
    env = os.environ.get("LOKA_DATA_DIR")
    if env:
        root = Path(env)
        return root / _FOLDER if (root / _FOLDER).is_dir() else root
    here = Path(__file__).resolve()
    # <repository>/packages/zoo/src/loka/zoo/data/amazon.py
    repository = here.parents[6] if len(here.parents) > 6 else here.parent
    return repository.parent / "shared" / "data" / _FOLDER


def dataset_path(name: str, data_dir: str | Path | None = None) -> Path:
    if name not in FILES:
        raise ValueError(f"unknown Amazon dataset {name!r}; choose one of {sorted(FILES)}")
    return Path(data_dir) if data_dir is not None else default_data_dir()


def is_available(name: str = "beauty", data_dir: str | Path | None = None) -> bool:
    return (dataset_path(name, data_dir) / FILES[name]).is_file()


@dataclass(frozen=True)
class AmazonSequences:
    """Every user's item sequence, stored jagged: user u's items are
    `values[offsets[u]:offsets[u + 1]]`, oldest first."""

    name: str
    path: Path
    values: np.ndarray  # int64 [interactions]
    offsets: np.ndarray  # int64 [users + 1]
    num_items: int

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, user: int) -> np.ndarray:
        return self.values[self.offsets[user] : self.offsets[user + 1]]


def load_amazon(name: str = "beauty", data_dir: str | Path | None = None) -> AmazonSequences:
    folder = dataset_path(name, data_dir)
    path = folder / FILES[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"Amazon {name!r} data not found at {path}; pass data_dir= or set LOKA_DATA_DIR "
            f"to the folder holding {FILES[name]}"
        )
    return parse_sequences(path, name=name)


def parse_sequences(path: Path, *, name: str) -> AmazonSequences:
    sequences: list[np.ndarray] = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                items = np.array(fields[1:], dtype=np.int64)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: item ids must be integers ({error})") from None
            if len(items) < 3:
                raise ValueError(
                    f"{path}:{number}: user {fields[0]} has {len(items)} items; leave-one-out "
                    "needs at least 3"
                )
            if items.min() < 1:
                raise ValueError(f"{path}:{number}: item ids start at 1, found {items.min()}")
            sequences.append(items)
    if not sequences:
        raise ValueError(f"{path}: no sequences")
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate(sequences)
    return AmazonSequences(name, path, values, offsets, int(values.max()))


# Leave-one-out: (history length, target position) per user, relative to each sequence.
def split_prefix(data: AmazonSequences, split: str) -> np.ndarray:
    """Per-user length of the history a split sees: n - 2 for train and valid, n - 1 for test."""
    if split in ("train", "valid"):
        return data.lengths - 2
    if split == "test":
        return data.lengths - 1
    raise ValueError(f"split must be 'train', 'valid' or 'test', got {split!r}")


def split_targets(data: AmazonSequences, split: str) -> np.ndarray:
    if split == "train":
        raise ValueError("the train split has no single target per user")
    return data.values[data.offsets[:-1] + split_prefix(data, split)]


def item_counts(data: AmazonSequences) -> np.ndarray:
    """Interactions per item `[num_items + 1]` in the training part only (no leakage)."""
    prefix = split_prefix(data, "train")
    in_train = np.arange(len(data.values)) - np.repeat(data.offsets[:-1], data.lengths)
    in_train = in_train < np.repeat(prefix, data.lengths)
    return np.bincount(data.values[in_train], minlength=data.num_items + 1)


def left_padded(
    data: AmazonSequences, users: np.ndarray, prefix: np.ndarray, width: int
) -> np.ndarray:
    """The last `width` items of each user's first `prefix[u]` items, left-padded with 0."""
    start = data.offsets[users]
    end = start + prefix[users]
    index = end[:, None] - width + np.arange(width)[None, :]
    valid = index >= start[:, None]
    return np.where(valid, data.values[np.clip(index, 0, None)], 0)


def sample_items(
    num_items: int,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    *,
    mode: NegativeSampling = "uniform",
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """Item ids in 1..num_items, uniformly or in proportion to `counts`."""
    if mode == "uniform":
        return rng.integers(1, num_items + 1, size=shape)
    if mode == "popularity":
        if counts is None or len(counts) != num_items + 1:
            raise ValueError("popularity sampling needs counts of length num_items + 1")
        weights = counts[1:].astype(np.float64)
        return 1 + rng.choice(num_items, size=shape, p=weights / weights.sum())
    raise ValueError(f"negative sampling must be 'uniform' or 'popularity', got {mode!r}")


def eval_negatives(
    data: AmazonSequences,
    num_negatives: int,
    *,
    seed: int,
    mode: NegativeSampling = "uniform",
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """`[users, num_negatives]` items each user never interacted with (repeats allowed)."""
    rng = np.random.default_rng(stream_seed(seed, 7, 0))
    users = data.num_users
    # Keys user * (num_items + 1) + item, sorted, answer "did u see i" by binary search.
    stride = data.num_items + 1
    seen = np.sort(np.repeat(np.arange(users), data.lengths) * stride + data.values)
    out = np.zeros((users, num_negatives), dtype=np.int64)
    filled = np.zeros(users, dtype=np.int64)
    todo = np.arange(users)
    for _ in range(100):
        draw = sample_items(
            data.num_items,
            (len(todo), num_negatives + num_negatives // 4 + 8),
            rng,
            mode=mode,
            counts=counts,
        )
        keys = todo[:, None] * stride + draw
        hit = np.searchsorted(seen, keys).clip(max=len(seen) - 1)
        fresh = seen[hit] != keys
        slot = np.cumsum(fresh, axis=1) - 1 + filled[todo][:, None]
        rows, cols = np.nonzero(fresh & (slot < num_negatives))
        out[todo[rows], slot[rows, cols]] = draw[rows, cols]
        filled[todo] = np.minimum(filled[todo] + fresh.sum(1), num_negatives)
        todo = todo[filled[todo] < num_negatives]
        if len(todo) == 0:
            return out
    raise ValueError(f"could not sample {num_negatives} unseen negatives for {len(todo)} users")


class AmazonStream:
    """Batches of one Amazon dataset on `device`, in the layouts of `loka.zoo.data.sequences`.

    Training batches go through the users in a seeded random order, epoch after epoch
    (the last partial batch of an epoch is dropped so shapes stay fixed); each window holds
    a user's last `max_seq_len + 1` training items. Evaluation batches are fixed per
    `eval_seed` and cover every user.
    """

    def __init__(
        self,
        data: AmazonSequences,
        *,
        batch_size: int,
        max_seq_len: int,
        layout: Layout = "padded",
        num_negatives: int = 128,
        negative_sampling: NegativeSampling = "uniform",
        num_eval_negatives: int = 100,
        eval_negative_sampling: NegativeSampling = "uniform",
        device: torch.device | str = "cpu",
        seed: int = 0,
        eval_seed: int = 0,
    ) -> None:
        check_layout(layout)
        if not 1 <= batch_size <= data.num_users:
            raise ValueError(f"batch_size must be in [1, {data.num_users}], got {batch_size}")
        self.data = data
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.layout = layout
        self.num_negatives = num_negatives
        self.negative_sampling = negative_sampling
        self.num_eval_negatives = num_eval_negatives
        self.eval_negative_sampling = eval_negative_sampling
        self.device = torch.device(device)
        self.seed = seed
        self.eval_seed = eval_seed
        self.counts = item_counts(data)
        train_prefix = split_prefix(data, "train")
        self._windows = left_padded(data, np.arange(data.num_users), train_prefix, max_seq_len + 1)
        self._window_lengths = np.minimum(train_prefix, max_seq_len + 1)
        self._eval: dict[str, list[dict[str, torch.Tensor]]] = {}
        # With popularity negatives the loss corrects each logit by log q (sampled softmax).
        probability = self.counts[1:] / self.counts[1:].sum()
        self._log_q = torch.from_numpy(np.log(np.maximum(probability, 1e-12))).float()

    def train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, step = 0, 0
        per_epoch = self.data.num_users // self.batch_size
        while True:
            order = np.random.default_rng(stream_seed(self.seed, 0, epoch)).permutation(
                self.data.num_users
            )
            for b in range(per_epoch):
                users = order[b * self.batch_size : (b + 1) * self.batch_size]
                yield self._train_batch(users, step)
                step += 1
            epoch += 1

    def _train_batch(self, users: np.ndarray, step: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self._windows[users]).to(self.device)
        lengths = torch.from_numpy(self._window_lengths[users])
        batch = training_batch(window, lengths, self.layout)
        rng = np.random.default_rng(stream_seed(self.seed, 1, step))
        negatives = sample_items(
            self.data.num_items,
            (self.num_negatives,),
            rng,
            mode=self.negative_sampling,
            counts=self.counts,
        )
        batch["negatives"] = torch.from_numpy(negatives).to(self.device)
        if self.negative_sampling == "popularity":
            batch["negative_logq"] = self._log_q[negatives - 1].to(self.device)
        return batch

    def eval_batches(
        self, n: int | None = None, *, split: str = "valid"
    ) -> list[dict[str, torch.Tensor]]:
        """The first n evaluation batches of a split (all of them when n is None)."""
        split_stream(split)
        if split not in self._eval:
            self._eval[split] = self._build_eval(split)
        batches = self._eval[split]
        if n is None:
            return list(batches)
        if not 1 <= n <= len(batches):
            raise ValueError(f"n must be in [1, {len(batches)}] for the {split} split, got {n}")
        return batches[:n]

    def _build_eval(self, split: str) -> list[dict[str, torch.Tensor]]:
        users = np.arange(self.data.num_users)
        history = left_padded(self.data, users, split_prefix(self.data, split), self.max_seq_len)
        negatives = eval_negatives(
            self.data,
            self.num_eval_negatives,
            seed=self.eval_seed,
            mode=self.eval_negative_sampling,
            counts=self.counts,
        )
        candidates = np.concatenate([split_targets(self.data, split)[:, None], negatives], 1)
        return [
            {
                "items": torch.from_numpy(history[i : i + self.batch_size]).to(self.device),
                "candidates": torch.from_numpy(candidates[i : i + self.batch_size]).to(self.device),
            }
            for i in range(0, len(users), self.batch_size)
        ]
