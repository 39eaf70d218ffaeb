"""Prompt examples from the leave-one-out split of an Amazon dataset.

Training: per user, a history cut from the training part (all but the last two items) and
the item that followed it (" Yes"), plus sampled items the user's training part does not
hold (" No"). Nothing of the validation or test targets is used.

Evaluation: per user, the history before the split's target and the target ranked against
a fixed, seeded set of negatives the user never interacted with (uniform, by popularity, or
"mixed": half each, as the original REPREC evaluation draws its 200; from
`loka.zoo.data.amazon.eval_negatives`), with the user's activity (items in that
history) for the cold / medium / warm breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from loka.zoo.data.amazon import (
    AmazonSequences,
    NegativeSampling,
    eval_negatives,
    item_counts,
    left_padded,
    sample_items,
    split_prefix,
    split_targets,
)
from loka.zoo.data.seeding import stream_seed

Cut = Literal["last", "random"]
# Negatives, for training and evaluation alike: "mixed" draws half by popularity (rounded
# down) and the rest uniform, side by side, as the original REPREC evaluation does.
EvalSampling = Literal["uniform", "popularity", "mixed"]
EVAL_SAMPLING: tuple[str, ...] = ("uniform", "popularity", "mixed")
TrainSampling = EvalSampling
TRAIN_SAMPLING = EVAL_SAMPLING
# Interactions in the history a prediction sees; the upper bounds are inclusive.
ACTIVITY_GROUPS: dict[str, tuple[int, float]] = {
    "cold": (1, 5),
    "medium": (6, 20),
    "warm": (21, float("inf")),
}


@dataclass(frozen=True)
class PromptExamples:
    history: torch.Tensor  # [N, L] left-padded item ids, most recent last
    candidates: torch.Tensor  # [N]
    labels: torch.Tensor  # [N] bool: True for " Yes" (the item that came next)

    def __len__(self) -> int:
        return len(self.candidates)

    def to(self, device: torch.device | str) -> PromptExamples:
        return PromptExamples(
            self.history.to(device), self.candidates.to(device), self.labels.to(device)
        )


def sampling_parts(sampling: str, count: int) -> list[tuple[NegativeSampling, int]]:
    """The draws a sampling makes: `(mode, count)` for one mode, popularity then uniform for
    "mixed" (see EVAL_SAMPLING); one line naming an unknown sampling."""
    if sampling == "mixed":
        return [("popularity", count // 2), ("uniform", count - count // 2)]
    if sampling in ("uniform", "popularity"):
        return [(sampling, count)]  # type: ignore[list-item]
    raise ValueError(f"negative_sampling must be one of {EVAL_SAMPLING}, got {sampling!r}")


def _training_keys(data: AmazonSequences) -> tuple[np.ndarray, int]:
    """Sorted `user * stride + item` of every training interaction, and the stride."""
    stride = data.num_items + 1
    position = np.arange(len(data.values)) - np.repeat(data.offsets[:-1], data.lengths)
    in_train = position < np.repeat(split_prefix(data, "train"), data.lengths)
    users = np.repeat(np.arange(data.num_users), data.lengths)
    return np.sort(users[in_train] * stride + data.values[in_train]), stride


def training_negatives(
    data: AmazonSequences,
    users: np.ndarray,
    num_negatives: int,
    rng: np.random.Generator,
    *,
    mode: NegativeSampling = "uniform",
) -> np.ndarray:
    """`[len(users), num_negatives]` items absent from each user's training part."""
    keys, stride = _training_keys(data)
    counts = item_counts(data) if mode == "popularity" else None
    out = np.zeros((len(users), num_negatives), dtype=np.int64)
    filled = np.zeros(len(users), dtype=np.int64)
    todo = np.arange(len(users))
    for _ in range(100):
        if len(todo) == 0:
            return out
        draw = sample_items(
            data.num_items, (len(todo), 2 * num_negatives + 8), rng, mode=mode, counts=counts
        )
        wanted = users[todo][:, None] * stride + draw
        fresh = keys[np.searchsorted(keys, wanted).clip(max=len(keys) - 1)] != wanted
        slot = np.cumsum(fresh, axis=1) - 1 + filled[todo][:, None]
        rows, cols = np.nonzero(fresh & (slot < num_negatives))
        out[todo[rows], slot[rows, cols]] = draw[rows, cols]
        filled[todo] = np.minimum(filled[todo] + fresh.sum(1), num_negatives)
        todo = todo[filled[todo] < num_negatives]
    raise ValueError(f"could not sample {num_negatives} negatives for {len(todo)} users")


def training_examples(
    data: AmazonSequences,
    *,
    width: int,
    num_negatives: int = 2,
    negative_sampling: TrainSampling = "uniform",
    cut: Cut = "last",
    history_items: int | None = None,
    users: np.ndarray | None = None,
    seed: int = 0,
    epoch: int = 0,
) -> PromptExamples:
    """One epoch of examples, shuffled: per user one positive and `num_negatives` negatives
    sharing its history. `cut="last"` predicts the last training item from the ones
    before it, `"random"` a uniformly drawn training item (after at least one other).
    `history_items` keeps only that many most recent items (the "cheap" setting); `users`
    restricts to a subset. Users whose training part holds fewer than 2 items are skipped.
    """
    if width < 1 or num_negatives < 0:
        raise ValueError(
            f"width must be positive and num_negatives >= 0, got {width}, {num_negatives}"
        )
    if cut not in ("last", "random"):
        raise ValueError(f"cut must be 'last' or 'random', got {cut!r}")
    if history_items is not None:
        if history_items < 1:
            raise ValueError(f"history_items must be positive, got {history_items}")
        width = min(width, history_items)
    rng = np.random.default_rng(stream_seed(seed, 13, epoch))
    prefix = split_prefix(data, "train")
    users = np.arange(data.num_users) if users is None else np.asarray(users, dtype=np.int64)
    users = users[prefix[users] >= 2]
    if len(users) == 0:
        raise ValueError("no user has 2 or more training items: nothing to train on")
    # The history length: all but the last training item, or uniform in [1, prefix - 1].
    cuts = prefix[users] - 1 if cut == "last" else rng.integers(1, prefix[users])
    history_length = np.zeros(data.num_users, dtype=np.int64)
    history_length[users] = cuts
    history = left_padded(data, users, history_length, width)
    positives = data.values[data.offsets[users] + cuts]
    negatives = np.concatenate(
        [
            training_negatives(data, users, count, rng, mode=mode)
            for mode, count in sampling_parts(negative_sampling, num_negatives)
        ],
        1,
    )
    candidates = np.concatenate([positives[:, None], negatives], 1).reshape(-1)
    labels = np.zeros((len(users), 1 + num_negatives), dtype=bool)
    labels[:, 0] = True
    history = np.repeat(history, 1 + num_negatives, axis=0)
    order = rng.permutation(len(candidates))
    return PromptExamples(
        torch.from_numpy(history[order]),
        torch.from_numpy(candidates[order]),
        torch.from_numpy(labels.reshape(-1)[order]),
    )


def membership_questions(
    data: AmazonSequences, users: np.ndarray, histories: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """For each left-padded history `[n, L]` (training items of `users`), a candidate and
    whether the history holds it: half the time one of its items (uniformly), else an item
    of the user's training part lacks, drawn by popularity (so popularity alone does not
    give the answer away)."""
    candidates, answers = pretraining_questions(data, users, histories, rng)
    return candidates[:, 0], answers[:, 0]


def pretraining_questions(
    data: AmazonSequences,
    users: np.ndarray,
    histories: np.ndarray,
    rng: np.random.Generator,
    *,
    count: int = 1,
    targets: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`count` questions `[n, count]` (candidates, answers) about each left-padded history
    `[n, L]` of `users`' training items, every answer " Yes" with probability 1/2 and "
    No" otherwise, so the answer's prior carries nothing and only the prompt tells them
    apart. Membership questions: a " Yes" candidate is one of the history's items, a " No"
    one an item the user's training part lacks, drawn by popularity (as the history's
    items are, so popularity alone does not give the answer away). With `targets` `[n]`
    (the item that followed each history), the first question asks about the next item
    instead: the target for " Yes", such a popularity-drawn item for " No"."""
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    lengths = (histories != 0).sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("membership questions need non-empty histories")
    rows = np.arange(len(users))[:, None]
    back = rng.integers(0, lengths[:, None], size=(len(users), count))
    picked = histories[rows, histories.shape[1] - 1 - back]
    absent = training_negatives(data, users, count, rng, mode="popularity")
    answers = rng.random((len(users), count)) < 0.5
    if targets is not None:
        picked[:, 0] = targets
    return np.where(answers, picked, absent), answers


@dataclass(frozen=True)
class EvalSet:
    split: str
    negative_sampling: str
    users: np.ndarray  # [U]
    history: torch.Tensor  # [U, L] left-padded
    candidates: torch.Tensor  # [U, 1 + N], column 0 the target
    activity: np.ndarray  # [U] items in each history (before truncation to L)


def sample_users(data: AmazonSequences, count: int | None, *, seed: int = 0) -> np.ndarray:
    """A seeded subset of `count` users (every user when None or >= the number of users)."""
    if count is None or count >= data.num_users:
        return np.arange(data.num_users)
    if count < 1:
        raise ValueError(f"the number of users must be positive, got {count}")
    rng = np.random.default_rng(stream_seed(seed, 17, 0))
    return np.sort(rng.choice(data.num_users, size=count, replace=False))


def eval_set(
    data: AmazonSequences,
    *,
    width: int,
    split: str = "test",
    users: np.ndarray | None = None,
    num_negatives: int = 100,
    negative_sampling: EvalSampling = "mixed",
    seed: int = 0,
) -> EvalSet:
    """The split's targets among `num_negatives` seeded negatives, for `users` (default all).
    `negative_sampling`: "uniform", "popularity", or "mixed" (half each, popularity first)."""
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
    users = np.arange(data.num_users) if users is None else np.asarray(users, dtype=np.int64)
    prefix = split_prefix(data, split)
    counts = item_counts(data)
    negatives = np.concatenate(
        [
            eval_negatives(data, count, seed=seed, mode=mode, counts=counts)
            for mode, count in sampling_parts(negative_sampling, num_negatives)
        ],
        axis=1,
    )
    candidates = np.concatenate([split_targets(data, split)[:, None], negatives], 1)[users]
    return EvalSet(
        split,
        negative_sampling,
        users,
        torch.from_numpy(left_padded(data, users, prefix, width)),
        torch.from_numpy(candidates),
        prefix[users],
    )


def activity_group(interactions: np.ndarray) -> np.ndarray:
    """The group name of each count of interactions ("" for 0)."""
    names = np.full(len(interactions), "", dtype=object)
    for name, (low, high) in ACTIVITY_GROUPS.items():
        names[(interactions >= low) & (interactions <= high)] = name
    return names
