"""REPREC data: training examples and pretraining text come from the training split only;
evaluation sets and activity groups; metrics per group against hand-computed values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loka.reprec.backbone import training_texts
from loka.reprec.evaluate import grouped_metrics
from loka.reprec.examples import (
    activity_group,
    eval_set,
    membership_questions,
    sample_users,
    training_examples,
    training_negatives,
)
from loka.zoo.data.amazon import AmazonSequences, parse_sequences, split_prefix

NUM_USERS, SHARED_ITEMS = 30, 40


def _sentinel_data(tmp_path: Path) -> AmazonSequences:
    """Every user's last two items (validation and test targets) are items no one else has
    and that nothing else holds: any of them in training data is a leak."""
    rng = np.random.default_rng(0)
    lines = []
    for user in range(NUM_USERS):
        body = rng.integers(1, SHARED_ITEMS + 1, int(rng.integers(1, 26)))
        sentinels = SHARED_ITEMS + 1 + 2 * user + np.arange(2)
        lines.append(" ".join(map(str, [user + 1, *body, *sentinels])))
    path = tmp_path / "Beauty.txt"
    path.write_text("\n".join(lines) + "\n")
    return parse_sequences(path, name="beauty")


def _sentinels(user: int) -> set[int]:
    return {SHARED_ITEMS + 1 + 2 * user, SHARED_ITEMS + 2 + 2 * user}


@pytest.mark.parametrize("cut", ["last", "random"])
def test_training_examples_leak_no_held_out_item(tmp_path: Path, cut: str) -> None:
    data = _sentinel_data(tmp_path)
    sentinels = set(range(SHARED_ITEMS + 1, data.num_items + 1))
    for epoch in range(3):
        examples = training_examples(data, width=8, num_negatives=3, cut=cut, epoch=epoch)
        held_out_in_history = set(examples.history.unique().tolist()) & sentinels
        positives = set(examples.candidates[examples.labels].tolist())
        assert not held_out_in_history
        assert not positives & sentinels


def test_pretraining_text_leaks_no_held_out_item(tmp_path: Path) -> None:
    data = _sentinel_data(tmp_path)
    users, texts = training_texts(data)
    assert texts.max() <= SHARED_ITEMS
    candidates, answers = membership_questions(data, users, texts, np.random.default_rng(0))
    assert candidates.max() <= SHARED_ITEMS  # popularity draws never reach unseen items
    for row, user in enumerate(users):
        history = set(texts[row][texts[row] > 0].tolist())
        assert (int(candidates[row]) in history) == bool(answers[row])
        assert not history & _sentinels(int(user))
    assert 0.3 < answers.mean() < 0.7
    # Every training item is there, each exactly as often as in the training parts.
    prefix = split_prefix(data, "train")
    expected = np.concatenate([data.sequence(u)[: prefix[u]] for u in users])
    assert sorted(texts[texts > 0].tolist()) == sorted(expected.tolist())


def test_training_examples_structure(tmp_path: Path) -> None:
    data = _sentinel_data(tmp_path)
    examples = training_examples(data, width=6, num_negatives=2, cut="last", seed=3)
    prefix = split_prefix(data, "train")
    trainable = int((prefix >= 2).sum())
    assert len(examples) == 3 * trainable and int(examples.labels.sum()) == trainable
    assert examples.history.shape == (3 * trainable, 6)
    # Each positive is the last training item and its history the items right before it.
    by_history: dict[tuple[int, ...], int] = {}
    for row in range(len(examples)):
        if examples.labels[row]:
            by_history[tuple(examples.history[row].tolist())] = int(examples.candidates[row])
    for user in np.flatnonzero(prefix >= 2):
        train = data.sequence(user)[: prefix[user]]
        history = train[:-1][-6:]
        key = tuple([0] * (6 - len(history)) + history.tolist())
        assert by_history[key] == train[-1]
    # Left-padded: no row ends with padding.
    assert examples.history[:, -1].ne(0).all()
    short = training_examples(data, width=6, num_negatives=1, history_items=2)
    assert short.history.shape[1] == 2


def test_training_negatives_avoid_the_users_training_items(tmp_path: Path) -> None:
    data = _sentinel_data(tmp_path)
    users = np.arange(data.num_users)
    negatives = training_negatives(data, users, 5, np.random.default_rng(0))
    prefix = split_prefix(data, "train")
    for user in users:
        assert not set(negatives[user].tolist()) & set(data.sequence(user)[: prefix[user]].tolist())
    assert negatives.min() >= 1 and negatives.max() <= data.num_items


def test_eval_set_targets_negatives_and_activity(tmp_path: Path) -> None:
    data = _sentinel_data(tmp_path)
    users = sample_users(data, 12, seed=1)
    assert len(users) == 12 and len(set(users.tolist())) == 12
    assert sample_users(data, None).tolist() == list(range(NUM_USERS))
    chosen = eval_set(data, width=10, users=users, num_negatives=20, negative_sampling="popularity")
    assert chosen.candidates.shape == (12, 21)
    for row, user in enumerate(users):
        sequence = data.sequence(user)
        assert int(chosen.candidates[row, 0]) == sequence[-1]  # the test target
        assert not set(chosen.candidates[row, 1:].tolist()) & set(sequence.tolist())
        assert chosen.activity[row] == len(sequence) - 1
        assert chosen.history[row, -1] == sequence[-2]
    valid = eval_set(data, width=10, split="valid", users=users)
    assert valid.candidates[:, 0].tolist() == [data.sequence(u)[-2] for u in users]
    with pytest.raises(ValueError, match="split"):
        eval_set(data, width=10, split="train")


def test_activity_groups_boundaries() -> None:
    names = activity_group(np.array([0, 1, 5, 6, 20, 21, 300]))
    assert names.tolist() == ["", "cold", "cold", "medium", "medium", "warm", "warm"]


def test_grouped_metrics_match_hand_computed_values() -> None:
    # Four users, the target in column 0 among 3 candidates.
    scores = torch.tensor(
        [
            [3.0, 1.0, 2.0],  # rank 1
            [1.0, 3.0, 2.0],  # rank 3
            [2.0, 3.0, 1.0],  # rank 2
            [2.0, 1.0, 0.0],  # rank 1
        ]
    )
    activity = np.array([2, 3, 10, 40])  # cold, cold, medium, warm
    metrics = grouped_metrics(scores, activity, ks=(2,))
    ndcg = {1: 1.0, 2: 1 / np.log2(3), 3: 0.0}
    assert metrics["all"]["users"] == 4
    assert metrics["all"]["hr@2"] == pytest.approx(3 / 4)
    assert metrics["all"]["ndcg@2"] == pytest.approx((ndcg[1] + ndcg[3] + ndcg[2] + ndcg[1]) / 4)
    assert metrics["all"]["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 2 + 1) / 4)
    assert metrics["cold"]["hr@2"] == pytest.approx(1 / 2)
    assert metrics["cold"]["mrr"] == pytest.approx((1 + 1 / 3) / 2)
    assert metrics["medium"]["ndcg@2"] == pytest.approx(ndcg[2])
    assert metrics["warm"] == {"users": 1, "hr@2": 1.0, "ndcg@2": 1.0, "mrr": 1.0}
    assert set(grouped_metrics(scores[:2], activity[:2])) == {"all", "cold"}
    with pytest.raises(ValueError, match="activity"):
        grouped_metrics(scores, activity[:3])


def test_mixed_training_negatives_draw_half_by_popularity(tmp_path: Path) -> None:
    """negative_sampling="mixed" (as the evaluation): popular items are drawn far more often
    than uniformly, still never one of the user's training items; unknown modes are refused."""
    from loka.reprec.train import TrainConfig

    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 61) ** 1.5  # items 1..60, a few of them most bought
    lines = [
        " ".join(map(str, [user + 1, *rng.choice(60, 8, p=weights / weights.sum()) + 1]))
        for user in range(80)
    ]
    (tmp_path / "Beauty.txt").write_text("\n".join(lines) + "\n")
    data = parse_sequences(tmp_path / "Beauty.txt", name="beauty")
    prefix = split_prefix(data, "train")
    popular = set(range(1, 11))

    def popular_share(mode: str) -> float:
        examples = training_examples(data, width=6, num_negatives=4, negative_sampling=mode, seed=1)
        negatives = examples.candidates[~examples.labels].tolist()
        return sum(n in popular for n in negatives) / len(negatives)

    assert popular_share("mixed") > popular_share("uniform") + 0.1
    assert popular_share("popularity") > popular_share("mixed") + 0.1
    examples = training_examples(data, width=6, num_negatives=4, negative_sampling="mixed")
    assert len(examples) == 5 * int((prefix >= 2).sum())
    for row in torch.nonzero(~examples.labels).flatten().tolist()[:50]:
        history = set(examples.history[row].tolist()) - {0}
        assert int(examples.candidates[row]) not in history
    with pytest.raises(ValueError, match="negative_sampling"):
        training_examples(data, width=6, negative_sampling="hard")
    with pytest.raises(ValueError, match="negative_sampling"):
        TrainConfig(negative_sampling="hard")
