"""Metrics against brute-force definitions."""

from __future__ import annotations

import math

import pytest
import torch

from loka.zoo.metrics import binary_auc, ctr_metrics, ranking_metrics


def _pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos.view(-1, 1) - neg.view(1, -1)
    return ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()


def test_auc_matches_pairwise_definition_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 7, (300,), generator=g).float()  # many ties
    labels = (torch.rand(300, generator=g) < 0.4).float()
    assert binary_auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)
    assert binary_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    with pytest.raises(ValueError, match="single class"):
        binary_auc(scores, torch.ones(300))


def test_ne_is_one_for_the_base_rate_predictor() -> None:
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0] * 25)
    logits = torch.full((100,), math.log(0.25 / 0.75))
    metrics = ctr_metrics(logits, labels)
    assert metrics["ne"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["logloss"] == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert metrics["auc"] == 0.5
    better = ctr_metrics(torch.where(labels > 0, 2.0, -2.0), labels)
    assert better["ne"] < 1.0 and better["auc"] == 1.0


def test_ctr_metrics_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="differ"):
        ctr_metrics(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        ctr_metrics(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, 1.0]))


def test_ranking_extremes() -> None:
    best = torch.cat([torch.ones(4, 1), torch.zeros(4, 100)], dim=1)
    assert ranking_metrics(best) == {"hr@10": 1.0, "ndcg@10": 1.0, "mrr": 1.0}
    worst = torch.cat([torch.zeros(4, 1), torch.ones(4, 100)], dim=1)
    metrics = ranking_metrics(worst)
    assert metrics["hr@10"] == 0.0 and metrics["ndcg@10"] == 0.0
    assert metrics["mrr"] == pytest.approx(1 / 101)
    third = torch.tensor([[0.5, 0.9, 0.7, 0.1]])
    assert ranking_metrics(third, k=2) == {
        "hr@2": 0.0, "ndcg@2": 0.0, "mrr": pytest.approx(1 / 3)
    }  # fmt: skip
    assert ranking_metrics(third, k=3)["ndcg@3"] == pytest.approx(0.5)


def test_ties_count_as_a_random_tie_break() -> None:
    constant = torch.zeros(3, 101)
    metrics = ranking_metrics(constant)
    assert metrics["hr@10"] == pytest.approx(10 / 101)
    assert metrics["mrr"] == pytest.approx(sum(1 / r for r in range(1, 102)) / 101)
    # Against an explicit average over many random tie-breaks.
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (50, 21), generator=g).float()
    jittered = [ranking_metrics(scores + 1e-3 * torch.rand(scores.shape, generator=g), k=5)
                for _ in range(400)]  # fmt: skip
    expected = ranking_metrics(scores, k=5)
    for key, value in expected.items():
        mean = sum(m[key] for m in jittered) / len(jittered)
        assert value == pytest.approx(mean, abs=0.01), key


def test_ranking_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="candidates"):
        ranking_metrics(torch.zeros(5))
    with pytest.raises(ValueError, match="NaN"):
        ranking_metrics(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="k must"):
        ranking_metrics(torch.zeros(2, 3), k=0)
