"""The Amazon 5-core loader: parsing, leave-one-out, negatives, batches. The tests on the
real files skip when the shared data folder is absent; the rest use a small file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loka.zoo.data import amazon

LINES = ["1 1 2 3 4 5", "2 6 7 8 9 10 4 11", "3 4 12 13 14 15 16 17 18 19", "4 2 3 5"]


@pytest.fixture
def small(tmp_path: Path) -> amazon.AmazonSequences:
    (tmp_path / "Beauty.txt").write_text("\n".join(LINES) + "\n")
    return amazon.load_amazon("beauty", tmp_path)


def test_parse_and_leave_one_out(small: amazon.AmazonSequences) -> None:
    assert small.num_users == 4 and small.num_items == 19
    assert list(small.sequence(1)) == [6, 7, 8, 9, 10, 4, 11]
    assert list(amazon.split_targets(small, "test")) == [5, 11, 19, 5]
    assert list(amazon.split_targets(small, "valid")) == [4, 4, 18, 3]
    assert list(amazon.split_prefix(small, "train")) == [3, 5, 7, 1]
    counts = amazon.item_counts(small)
    # Validation and test items never count: item 5 appears only as user 4's test target.
    assert counts[5] == 0 and counts[4] == 1 and counts[2] == 2 and counts.sum() == 16
    with pytest.raises(ValueError, match="single target"):
        amazon.split_targets(small, "train")


def test_left_padding_keeps_the_most_recent_items(small: amazon.AmazonSequences) -> None:
    users = np.arange(4)
    windows = amazon.left_padded(small, users, amazon.split_prefix(small, "test"), 5)
    assert windows.tolist() == [
        [0, 1, 2, 3, 4], [7, 8, 9, 10, 4], [14, 15, 16, 17, 18], [0, 0, 0, 2, 3]
    ]  # fmt: skip


def test_eval_negatives_are_unseen_and_seeded(small: amazon.AmazonSequences) -> None:
    negatives = amazon.eval_negatives(small, 6, seed=3)
    assert negatives.shape == (4, 6) and negatives.min() >= 1 and negatives.max() <= 19
    for user in range(4):
        assert not set(negatives[user]) & set(small.sequence(user))
    assert np.array_equal(negatives, amazon.eval_negatives(small, 6, seed=3))
    assert not np.array_equal(negatives, amazon.eval_negatives(small, 6, seed=4))


def test_popularity_sampling_follows_counts() -> None:
    counts = np.array([0, 1, 0, 9])
    draws = amazon.sample_items(
        3, (4000,), np.random.default_rng(0), mode="popularity", counts=counts
    )
    assert set(np.unique(draws)) == {1, 3} and 0.85 < (draws == 3).mean() < 0.95
    with pytest.raises(ValueError, match="negative sampling"):
        amazon.sample_items(3, (2,), np.random.default_rng(0), mode="hard")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_stream_batches(small: amazon.AmazonSequences, layout: str) -> None:
    stream = amazon.AmazonStream(
        small, batch_size=2, max_seq_len=4, layout=layout, num_negatives=5,  # type: ignore[arg-type]
        negative_sampling="popularity", num_eval_negatives=3,
    )  # fmt: skip
    batches = stream.train_batches()
    epoch = [next(batches) for _ in range(2)]  # 4 users, 2 per batch
    pairs = 0
    for batch in epoch:
        assert batch["negatives"].shape == (5,) and batch["negative_logq"].shape == (5,)
        if layout == "jagged":
            assert batch["offsets"][-1] == batch["items"].numel() == batch["targets"].numel()
            pairs += batch["items"].numel()
        else:
            assert batch["items"].shape == (2, 4)
            pairs += int(((batch["items"] != 0) & (batch["targets"] != 0)).sum())
    # Training windows hold min(prefix, 5) items: 3, 5, 5, 1 -> 2 + 4 + 4 + 0 pairs.
    assert pairs == 10
    valid = stream.eval_batches(split="valid")
    assert [b["items"].shape[0] for b in valid] == [2, 2]
    assert torch.cat([b["candidates"][:, 0] for b in valid]).tolist() == [4, 4, 18, 3]
    assert valid[0]["items"][1].tolist() == [7, 8, 9, 10]
    assert stream.eval_batches(1, split="test")[0]["candidates"][:, 0].tolist() == [5, 11]
    with pytest.raises(ValueError, match="n must be"):
        stream.eval_batches(3)


def test_bad_files_and_folders_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="LOKA_DATA_DIR"):
        amazon.load_amazon("beauty", tmp_path)
    with pytest.raises(ValueError, match="unknown Amazon dataset"):
        amazon.load_amazon("books", tmp_path)
    (tmp_path / "Beauty.txt").write_text("1 1 2 3\n2 5 6\n")
    with pytest.raises(ValueError, match=r"Beauty.txt:2: user 2 has 2 items"):
        amazon.load_amazon("beauty", tmp_path)
    (tmp_path / "Beauty.txt").write_text("1 1 2 x\n")
    with pytest.raises(ValueError, match=r"Beauty.txt:1: item ids must be integers"):
        amazon.load_amazon("beauty", tmp_path)
    (tmp_path / "amazon-5core").mkdir()
    monkeypatch.setenv("LOKA_DATA_DIR", str(tmp_path))
    assert amazon.default_data_dir() == tmp_path / "amazon-5core"
    monkeypatch.setenv("LOKA_DATA_DIR", str(tmp_path / "amazon-5core"))
    assert amazon.default_data_dir() == tmp_path / "amazon-5core"


needs_beauty = pytest.mark.skipif(
    not amazon.is_available("beauty"),
    reason=f"Amazon Beauty data absent from {amazon.default_data_dir()} (set LOKA_DATA_DIR)",
)


@needs_beauty
def test_real_beauty_file_matches_its_readme() -> None:
    data = amazon.load_amazon("beauty")
    assert data.num_users == 22_363 and len(data.values) == 198_502
    assert data.lengths.min() >= 5  # 5-core
    assert np.unique(data.values).size == data.num_items  # contiguous ids 1..num_items
