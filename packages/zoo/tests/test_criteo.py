"""The synthetic Criteo-like stream: shapes, determinism, distributions, teacher."""

from __future__ import annotations

import pytest
import torch

from loka.zoo.data.criteo import (
    CRITEO_CARDINALITIES,
    SyntheticCriteo,
    SyntheticCriteoConfig,
    criteo_cardinalities,
)
from loka.zoo.metrics import ctr_metrics

SMALL = SyntheticCriteoConfig(cardinalities=criteo_cardinalities(26, 5000))


def test_cardinalities_cycle_and_cap() -> None:
    assert criteo_cardinalities() == CRITEO_CARDINALITIES
    assert criteo_cardinalities(28, 1000)[26:] == (1000, 583)
    assert max(criteo_cardinalities(26, 1000)) == 1000
    with pytest.raises(ValueError, match="num_sparse"):
        criteo_cardinalities(0)


def test_batch_layout_and_ranges() -> None:
    stream = SyntheticCriteo(SMALL, 512, seed=1)
    batch = stream.batch(0)
    assert batch["dense"].shape == (512, 13) and batch["dense"].dtype == torch.float32
    assert batch["label"].shape == (512,) and set(batch["label"].unique().tolist()) <= {0.0, 1.0}
    sparse = batch["sparse"]
    assert sparse.shape == (512, 26, stream.bag_size) and sparse.dtype == torch.int64
    sizes = torch.tensor(SMALL.cardinalities).view(1, -1, 1)
    assert ((sparse >= -1) & (sparse < sizes)).all()
    # Every bag holds at least one id, and padding only fills its tail.
    assert (sparse[:, :, 0] >= 0).all()
    padded = sparse < 0
    assert (padded[:, :, :-1] <= padded[:, :, 1:]).all()
    assert padded.any() and (~padded[:, :, 1:]).any(), "expected both one-hot and multi-hot bags"
    # log1p of zero-inflated counts: non-negative with a share of exact zeros.
    assert (batch["dense"] >= 0).all() and 0.0 < (batch["dense"] == 0).float().mean() < 0.4


def test_deterministic_per_seed_and_index() -> None:
    a, b, c = (SyntheticCriteo(SMALL, 64, seed=s) for s in (7, 7, 8))
    for key in ("dense", "sparse", "label"):
        assert torch.equal(a.batch(3)[key], b.batch(3)[key])
    assert not torch.equal(a.batch(3)["sparse"], a.batch(4)["sparse"])
    assert not torch.equal(a.batch(3)["sparse"], c.batch(3)["sparse"])
    first = next(a.train_batches())
    assert torch.equal(first["dense"], a.batch(0)["dense"])
    # Held-out data depends on the dataset only.
    assert torch.equal(a.eval_batches(2)[1]["sparse"], c.eval_batches(2)[1]["sparse"])


def test_ids_follow_a_power_law() -> None:
    config = SyntheticCriteoConfig(cardinalities=(100_000,), max_bag_size=1)
    ids = SyntheticCriteo(config, 20_000).batch(0)["sparse"].flatten()
    counts = torch.bincount(ids, minlength=100_000).sort(descending=True).values
    top_share = counts[:1000].sum() / counts.sum()  # the hottest 1% of ids
    assert top_share > 0.3, f"top 1% ids take {top_share:.2f} of lookups"
    assert (counts > 0).sum() > 2000, "the tail must still be visited"


def test_teacher_sets_the_click_rate_and_is_learnable() -> None:
    config = SyntheticCriteoConfig(cardinalities=SMALL.cardinalities, positive_rate=0.2)
    stream = SyntheticCriteo(config, 8192)
    batch = stream.eval_batches(1)[0]
    assert abs(batch["label"].mean().item() - 0.2) < 0.03
    oracle = ctr_metrics(stream.oracle_logits(batch), batch["label"])
    assert oracle["ne"] < 0.85 and oracle["auc"] > 0.75
    # A stronger teacher signal makes labels more predictable.
    oracle_ne = {}
    for signal in (0.5, 4.0):
        config = SyntheticCriteoConfig(cardinalities=SMALL.cardinalities, teacher_signal=signal)
        stream = SyntheticCriteo(config, 8192)
        batch = stream.eval_batches(1)[0]
        oracle_ne[signal] = ctr_metrics(stream.oracle_logits(batch), batch["label"])["ne"]
    assert oracle_ne[4.0] < oracle_ne[0.5] - 0.2, oracle_ne


def test_teacher_seed_names_the_dataset() -> None:
    a = SyntheticCriteo(SMALL, 256)
    b = SyntheticCriteo(SyntheticCriteoConfig(SMALL.cardinalities, teacher_seed=1), 256)
    batch = a.batch(0)
    assert not torch.allclose(a.oracle_logits(batch), b.oracle_logits(batch))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cardinalities", (10, 0), "cardinalities"),
        ("positive_rate", 1.0, "positive_rate"),
        ("teacher_signal", 0.0, "teacher_signal"),
        ("max_bag_size", 0, "max_bag_size"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticCriteoConfig(**{field: value})


def test_stream_rejects_bad_batch_size_and_split() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticCriteo(SMALL, 0)
    with pytest.raises(ValueError, match="split"):
        SyntheticCriteo(SMALL, 4).eval_batches(1, split="train")
