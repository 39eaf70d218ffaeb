"""Losses and metrics of the two task families: click prediction and next-item ranking."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from loka.zoo.metrics import ctr_metrics, ranking_metrics

__all__ = [
    "click_loss",
    "click_metrics",
    "next_item_loss",
    "next_item_metrics",
]

Batch = dict[str, torch.Tensor]


def click_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Binary cross-entropy of `model(batch)` logits `[B]` against `batch["label"]`."""
    logits = model(batch)
    label = batch["label"]
    if logits.shape != label.shape:
        raise ValueError(
            f"model logits {tuple(logits.shape)} do not match labels {tuple(label.shape)}"
        )
    return F.binary_cross_entropy_with_logits(logits.float(), label.float())


def next_item_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sampled softmax: the target against the batch's shared negatives, at every position
    that has both an input item and a target. Negatives that equal the target are masked;
    `negative_logq` (when the negatives were drawn by popularity) corrects their logits."""
    logits = model(batch).float()
    targets = batch["targets"]
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"model scores {tuple(logits.shape)} do not match targets {tuple(targets.shape)}"
        )
    negative = logits[..., 1:]
    if "negative_logq" in batch:
        negative = negative - batch["negative_logq"].float()
    accidental = batch["negatives"].view(*(1,) * targets.dim(), -1) == targets.unsqueeze(-1)
    negative = negative.masked_fill(accidental, float("-inf"))
    logits = torch.cat([logits[..., :1], negative], dim=-1)
    valid = targets != 0
    if "offsets" not in batch:
        valid = valid & (batch["items"] != 0)
    per_position = F.cross_entropy(
        logits.flatten(0, -2), torch.zeros_like(targets.flatten()), reduction="none"
    )
    # A batch with no valid position gives 0, not NaN: nothing to learn, nothing broken.
    return (per_position * valid.flatten()).sum() / valid.sum().clamp_min(1)


@torch.no_grad()
def _collect(
    model: nn.Module, batches: Iterable[Batch], key: str | None
) -> tuple[torch.Tensor, ...]:
    was_training = model.training
    model.eval()
    try:
        outputs, labels = [], []
        for batch in batches:
            outputs.append(model(batch).float())
            if key is not None:
                labels.append(batch[key])
    finally:
        model.train(was_training)
    if not outputs:
        raise ValueError("metrics need at least one evaluation batch")
    return (torch.cat(outputs), torch.cat(labels)) if key is not None else (torch.cat(outputs),)


def click_metrics(model: nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
    logits, labels = _collect(model, batches, "label")
    return ctr_metrics(logits, labels)


def next_item_metrics(model: nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
    (scores,) = _collect(model, batches, None)
    return ranking_metrics(scores, k=10)
