"""Synthetic sequences and the padded/jagged layouts."""

from __future__ import annotations

import pytest
import torch

from loka.zoo.data.sequences import SyntheticSequences, SyntheticSequencesConfig, training_batch

CONFIG = SyntheticSequencesConfig(num_items=300, max_seq_len=12, num_clusters=10)


def test_padded_batches_are_left_padded_with_shifted_targets() -> None:
    batch = SyntheticSequences(CONFIG, 16).batch(0)
    items, targets = batch["items"], batch["targets"]
    assert items.shape == targets.shape == (16, 12)
    assert batch["negatives"].shape == (CONFIG.num_negatives,)
    assert items.min() >= 0 and items.max() <= 300 and targets[:, -1].min() >= 1
    pad = items == 0
    assert (pad[:, :-1] >= pad[:, 1:]).all(), "padding must come first"
    # targets are the items shifted by one: targets[:, :-1] == items[:, 1:]
    assert torch.equal(targets[:, :-1], items[:, 1:])


def test_jagged_batches_hold_the_same_pairs() -> None:
    padded = SyntheticSequences(CONFIG, 16, seed=2).batch(5)
    jagged = SyntheticSequences(
        SyntheticSequencesConfig(**{**CONFIG.__dict__, "layout": "jagged"}), 16, seed=2
    ).batch(5)
    real = padded["items"] != 0
    assert torch.equal(padded["items"][real], jagged["items"])
    assert torch.equal(padded["targets"][real], jagged["targets"])
    lengths = jagged["offsets"].diff()
    assert torch.equal(lengths, real.sum(1)) and jagged["offsets"][-1] == jagged["items"].numel()
    assert torch.equal(padded["negatives"], jagged["negatives"])


def test_training_batch_rejects_unknown_layout() -> None:
    window = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="layout"):
        training_batch(window, torch.tensor([4, 4]), "ragged")  # type: ignore[arg-type]


def test_eval_batches_hold_out_the_last_item() -> None:
    stream = SyntheticSequences(CONFIG, 8)
    batch = stream.eval_batches(1)[0]
    assert batch["items"].shape == (8, 12)
    assert batch["candidates"].shape == (8, 1 + CONFIG.num_eval_negatives)
    assert (batch["candidates"] >= 1).all() and (batch["candidates"] <= 300).all()
    assert torch.equal(batch["items"], stream.eval_batches(1)[0]["items"])
    assert not torch.equal(batch["items"], stream.eval_batches(1, split="test")[0]["items"])


def test_history_predicts_the_next_item_beyond_popularity() -> None:
    """The generator's point: a user's items concentrate in a couple of clusters."""
    stream = SyntheticSequences(CONFIG, 512)
    batch = stream.batch(0)
    items = batch["items"]
    distinct = torch.tensor([row[row != 0].unique().numel() for row in items])
    lengths = (items != 0).sum(1)
    assert (distinct.float() / lengths.clamp_min(1)).mean() < 0.9
    counts = stream.item_counts(4)
    assert counts[0] == 0 and counts.sum() > 0
    top = counts.sort(descending=True).values
    assert top[:30].sum() > 0.2 * top.sum(), "items within clusters follow a power law"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layout", "ragged"),
        ("num_clusters", 0),
        ("min_len", 1),
        ("zipf_alpha", 1.0),
        ("noise", 2.0),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticSequencesConfig(**{field: value})
