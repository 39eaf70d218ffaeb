"""SASRec trained briefly on Amazon Beauty beats the popularity baseline on the validation
split (HR@10 and NDCG@10 against 100 sampled negatives). Skips without the shared data."""

from __future__ import annotations

import pytest

import loka.zoo as zoo
from loka.zoo.data import amazon


@pytest.mark.slow
@pytest.mark.skipif(
    not amazon.is_available("beauty"),
    reason=f"Amazon Beauty data absent from {amazon.default_data_dir()} (set LOKA_DATA_DIR)",
)
def test_sasrec_beats_popularity_on_beauty() -> None:
    # A small budget (400 steps, about 2.3 epochs); bench/results/zoo_sasrec_beauty.json
    # records a longer run.
    setup = zoo.create("sasrec", "base", dataset="beauty", max_seq_len=20, seed=0)
    held_out = setup.eval_batches(split="valid")
    popular = setup.metrics(setup.popularity_baseline(), held_out)
    zoo.train(setup, 400, lr=5e-3)
    model = setup.metrics(setup.model, held_out)
    assert model["hr@10"] > popular["hr@10"] + 0.04, (model, popular)
    assert model["ndcg@10"] > popular["ndcg@10"] + 0.05, (model, popular)
