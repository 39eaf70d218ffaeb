"""The Criteo-like stream with a behaviour sequence per example (InterFormer's data)."""

from __future__ import annotations

import pytest
import torch

from loka.zoo.data.behaviour import SyntheticBehaviour, SyntheticBehaviourConfig
from loka.zoo.data.criteo import SyntheticCriteo, criteo_cardinalities
from loka.zoo.metrics import ctr_metrics

SMALL = SyntheticBehaviourConfig(
    cardinalities=criteo_cardinalities(26, 2000), num_items=400, max_seq_len=12, num_clusters=8
)


def test_batches_carry_a_left_padded_sequence() -> None:
    stream = SyntheticBehaviour(SMALL, 512, seed=1)
    batch = stream.batch(0)
    assert set(batch) == {"dense", "sparse", "sequence", "label"}
    sequence = batch["sequence"]
    assert sequence.shape == (512, 12) and sequence.dtype == torch.int64
    assert sequence.min() >= 0 and sequence.max() <= 400
    pad = sequence == 0
    assert (pad[:, :-1] >= pad[:, 1:]).all(), "padding must come first"
    lengths = (~pad).sum(1)
    assert lengths.min() >= SMALL.min_seq_len and lengths.max() == 12
    assert batch["sparse"].shape[:2] == (512, 26) and batch["dense"].shape == (512, 13)
    assert abs(batch["label"].mean().item() - SMALL.positive_rate) < 0.06


def test_deterministic_per_seed_and_held_out_by_dataset() -> None:
    a, b, c = (SyntheticBehaviour(SMALL, 64, seed=s) for s in (7, 7, 8))
    for key in ("dense", "sparse", "sequence", "label"):
        assert torch.equal(a.batch(2)[key], b.batch(2)[key])
    assert not torch.equal(a.batch(2)["sequence"], c.batch(2)["sequence"])
    assert torch.equal(a.eval_batches(1)[0]["sequence"], c.eval_batches(1)[0]["sequence"])


def test_a_users_items_concentrate_in_few_clusters() -> None:
    stream = SyntheticBehaviour(SMALL, 256)
    sequence = stream.batch(0)["sequence"]
    clusters = stream._behaviour.cluster_of[sequence]
    distinct = [
        row[item != 0].unique().numel() for row, item in zip(clusters, sequence, strict=True)
    ]
    # Two interest clusters plus 20% noise over 8 clusters: well under the 8 a random user hits.
    assert sum(distinct) / len(distinct) < 4.5


def test_the_label_depends_on_the_sequence_and_the_candidate_together() -> None:
    stream = SyntheticBehaviour(SMALL, 8192)
    batch = stream.eval_batches(1)[0]
    labels = batch["label"]
    oracle = ctr_metrics(stream.oracle_logits(batch), labels)
    g = torch.Generator().manual_seed(0)
    shuffled = batch["sequence"][torch.randperm(8192, generator=g)]
    without = ctr_metrics(stream.oracle_logits({**batch, "sequence": shuffled}), labels)
    assert oracle["ne"] < without["ne"] - 0.1, (oracle, without)
    # No sequence signal: the oracle ignores the sequence.
    flat = SyntheticBehaviour(
        SyntheticBehaviourConfig(**{**SMALL.__dict__, "sequence_share": 0.0}), 64
    )
    small = flat.batch(0)
    torch.testing.assert_close(
        flat.oracle_logits(small),
        flat.oracle_logits({**small, "sequence": small["sequence"].flip(0)}),
    )


def test_dense_and_sparse_features_are_the_criteo_streams() -> None:
    """Same features as the plain stream for a seed and index: only the label and the
    sequence are new."""
    plain = SyntheticCriteo(SMALL, 32, seed=3).batch(1)
    behaviour = SyntheticBehaviour(SMALL, 32, seed=3).batch(1)
    assert torch.equal(plain["dense"], behaviour["dense"])
    assert torch.equal(plain["sparse"], behaviour["sparse"])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_seq_len", 20, "min_seq_len"),
        ("num_clusters", 0, "num_clusters"),
        ("sequence_share", 1.5, "sequence_share"),
        ("recency", 0.0, "recency"),
        ("candidate_feature", -1, "candidate_feature"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticBehaviourConfig(**{**SMALL.__dict__, field: value})
