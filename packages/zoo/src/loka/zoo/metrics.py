"""Quality metrics: log loss, normalized entropy and AUC for click prediction; HR@K,
NDCG@K and MRR for ranking a held-out item among sampled candidates."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "binary_auc",
    "ctr_metrics",
    "ranking_metrics",
]


def _check_finite(scores: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{what} contain NaN or Inf")


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U); tied scores count one half."""
    scores, labels = scores.detach().double().flatten(), labels.detach().flatten()
    positives = int((labels > 0.5).sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC is undefined: the labels hold a single class")
    ordered, order = torch.sort(scores)
    _, counts = torch.unique_consecutive(ordered, return_counts=True)
    # Tied scores share the mean of their 1-based ranks.
    ends = torch.cumsum(counts, 0).double()
    mean_rank = torch.repeat_interleave(ends - (counts.double() - 1) / 2, counts)
    positive_rank_sum = mean_rank[labels[order] > 0.5].sum().item()
    return (positive_rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def ctr_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """`logloss`, `ne` (log loss over the entropy of the empirical click rate) and `auc`."""
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ")
    _check_finite(logits, "logits")
    logits, labels = logits.detach().double(), labels.detach().double()
    logloss = F.binary_cross_entropy_with_logits(logits, labels).item()
    rate = labels.mean().item()
    if not 0.0 < rate < 1.0:
        raise ValueError(f"NE is undefined: the click rate of the labels is {rate}")
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return {"logloss": logloss, "ne": logloss / entropy, "auc": binary_auc(logits, labels)}


def ranking_metrics(scores: torch.Tensor, k: int = 10) -> dict[str, float]:
    """`hr@k`, `ndcg@k` and `mrr` of the item in column 0 of `scores` `[N, C]`.

    Ties with the target are broken uniformly at random, in expectation: a target tied with
    e candidates and beaten by g takes each rank g .. g + e with probability 1 / (e + 1).
    That keeps constant or coarse scorers (popularity) from looking better than they are.
    """
    if scores.dim() != 2 or scores.size(1) < 2:
        raise ValueError(f"scores must be [rows, candidates >= 2], got {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    _check_finite(scores, "scores")
    scores = scores.detach().double()
    target, others = scores[:, :1], scores[:, 1:]
    beaten_by = (others > target).sum(1, keepdim=True)
    tied = (others == target).sum(1, keepdim=True)
    offset = torch.arange(scores.size(1), device=scores.device).view(1, -1)
    rank = (beaten_by + offset).double()  # 0-based rank for each tie-break outcome
    weight = (offset <= tied).double() / (tied + 1).double()
    hit = (rank < k).double()
    return {
        f"hr@{k}": (weight * hit).sum(1).mean().item(),
        f"ndcg@{k}": (weight * hit / torch.log2(rank + 2)).sum(1).mean().item(),
        "mrr": (weight / (rank + 1)).sum(1).mean().item(),
    }
