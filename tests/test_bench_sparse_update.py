"""bench/sparse_update.py on the CPU: importing it runs nothing; its smoke run checks every
method against coalescing first and writes one JSON record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

sparse_update = harness.load("sparse_update")  # importing it runs nothing


def test_arguments_are_parsed_in_main_with_the_xl_preset_by_default():
    args = sparse_update.parse_args([])
    assert (args.model, args.preset, args.smoke) == ("wukong", None, False)
    with pytest.raises(ValueError, match="method"):
        sparse_update.make_step("hash", None)


def test_lookup_stats_counts_duplicates():
    torch = pytest.importorskip("torch")
    stats = sparse_update.lookup_stats(torch.tensor([4, 1, 4, 4, 9]))
    assert stats == {"lookups": 5, "distinct_rows": 3, "hottest_row_lookups": 3}
    assert sparse_update.lookup_stats(torch.tensor([], dtype=torch.int64))["lookups"] == 0


def test_smoke_run_checks_and_times_old_and_new_steps(tmp_path):
    pytest.importorskip("torch")
    path = sparse_update.main(["--smoke", "--batch-size", "64", "--reps", "1", "--out",
                               str(tmp_path), "--device", "cpu"])  # fmt: skip
    record = json.loads(Path(path).read_text())
    config = record["config"]
    assert (config["model"], config["preset"], config["batch_size"]) == ("wukong", "tiny", 64)
    assert config["lookups"] > config["distinct_rows"] > 0  # duplicates, as in training
    rows = {row["method"]: row for row in record["rows"]}
    assert set(rows) == {"coalesce", "sort"}  # sort-torch: CUDA only
    for row in rows.values():
        assert row["ms"] > 0 and row["host_ms"] > 0
        assert row["max_abs_err_weight"] < 1e-5 and row["max_rel_err_state"] < 1e-5
    assert rows["coalesce"]["speedup_vs_coalesce"] == 1
    assert record["meta"]["mode"] == "smoke"
    assert set(record["context"]) == {"padding_idx=0", "no padding_idx"}
    assert all(times["ms"] > 0 for times in record["context"].values())
