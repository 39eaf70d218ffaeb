"""bench/sparse_update.py on the CPU: importing it runs nothing; its smoke run checks every
method against coalescing first and writes one JSON record."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

# Triton's interpreter is chosen when triton.language is imported: set it before that.
_INTERPRETED = "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
os.environ.setdefault("TRITON_INTERPRET", "1")
sparse_update = harness.load("sparse_update")  # importing it runs nothing


def test_arguments_are_parsed_in_main_with_the_xl_preset_by_default():
    args = sparse_update.parse_args([])
    assert (args.model, args.preset, args.smoke) == ("wukong", None, False)
    with pytest.raises(ValueError, match="method"):
        sparse_update.make_step("hash", None)


def test_variants_parse_and_set_the_sort_paths_constants_for_a_step():
    pytest.importorskip("torch")
    from loka.zoo import rowwise_adagrad

    variants = sparse_update.parse_variants("update_rows=4; CHUNK=64,HEADS=8;")
    assert variants == [{"UPDATE_ROWS": 4}, {"CHUNK": 64, "HEADS": 8}]
    assert sparse_update.variant_name(variants[1]) == "sort[CHUNK=64,HEADS=8]"
    assert sparse_update.parse_variants("") == []
    for bad in ("BLOCK=4", "CHUNK=0", "CHUNK=x"):
        with pytest.raises(ValueError, match="positive integers"):
            sparse_update.parse_variants(bad)
    before = rowwise_adagrad.CHUNK
    with sparse_update.tuned({"CHUNK": 64}):
        assert rowwise_adagrad.CHUNK == 64
    assert before == rowwise_adagrad.CHUNK


def test_a_variant_step_updates_like_the_default(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if not (_INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    from loka.zoo import optim, rowwise_adagrad

    # Route the sort path to the Triton kernels on the CPU (the interpreter).
    calls = []

    def triton_update(*args, **kwargs):
        calls.append(dict(CHUNK=rowwise_adagrad.CHUNK, HEADS=rowwise_adagrad.HEADS,
                          UPDATE_ROWS=rowwise_adagrad.UPDATE_ROWS))  # fmt: skip
        rowwise_adagrad.rowwise_adagrad_sparse_triton_(*args, **kwargs)

    monkeypatch.setattr(optim, "rowwise_adagrad_sparse_", triton_update)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (150,), generator=g)
    values = torch.randn(150, 4, generator=g)
    start = torch.randn(9, 4, generator=g)
    results = []
    defaults = (rowwise_adagrad.UPDATE_ROWS, rowwise_adagrad.HEADS)
    for method in ("coalesce", "sort[UPDATE_ROWS=4,HEADS=2]"):
        weight = torch.nn.Parameter(start.clone())
        with torch.sparse.check_sparse_tensor_invariants():
            weight.grad = torch.sparse_coo_tensor(ids[None], values, weight.shape)
        step, state = sparse_update.make_step(method, weight)
        step()
        results.append((weight.detach(), state()))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
    assert calls == [dict(CHUNK=rowwise_adagrad.CHUNK, HEADS=2, UPDATE_ROWS=4)]
    assert defaults == (rowwise_adagrad.UPDATE_ROWS, rowwise_adagrad.HEADS)  # restored


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
    assert set(record["context"]) == {
        "padding_idx=0", "no padding_idx", "fused update in backward"
    }  # fmt: skip
    assert all(times["ms"] > 0 for times in record["context"].values())
