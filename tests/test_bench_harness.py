"""bench/harness.py: the arguments, budget, timing, error metric, metadata and atomic writes
every benchmark script shares (CPU, no benchmark run)."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness


def test_parser_takes_out_and_budget_with_defaults(monkeypatch):
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    args = harness.parser("A bench.\n\nMore text.", budget_s=60).parse_args([])
    assert (args.out, args.budget_s) == ("/tmp/somewhere", 60)
    monkeypatch.delenv("OUT")
    args = harness.parser(None).parse_args(["--budget-s", "2.5"])
    assert args.out == str(harness.RESULTS) and args.budget_s == 2.5


def test_budget_counts_down_and_shares_what_is_left():
    now = [100.0]
    budget = harness.Budget(10, clock=lambda: now[0])
    now[0] = 104.0
    assert budget.elapsed() == 4 and budget.left() == 6
    assert budget.share(0.5) == 7  # 4 s spent + half of the 6 left
    assert not budget.over(5) and budget.over(7)
    assert harness.Budget(None).left() == float("inf")


def test_rel_err_is_the_relative_frobenius_norm():
    ref = torch.tensor([3.0, 4.0])
    assert harness.rel_err(ref, ref) == 0
    assert harness.rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert harness.rel_err(torch.zeros(2), torch.zeros(2)) == 0


def test_time_ms_calls_once_untimed_then_reps_times():
    calls = []
    ms = harness.time_ms(lambda: calls.append(1), "cpu", reps=3)
    assert len(calls) == 4 and ms >= 0


def test_metadata_records_command_versions_and_extra():
    meta = harness.metadata("cpu", mode="smoke", budget_s=5)
    assert meta["torch"] == torch.__version__ and meta["capability"] is None
    assert meta["mode"] == "smoke" and meta["budget_s"] == 5
    assert set(meta) >= {"command", "date_utc", "device", "python", "git_commit", "cuda"}
    assert harness.metadata("cpu", device="cpu (interpreter)")["device"] == "cpu (interpreter)"
    assert harness.stamp(dt.datetime(2026, 12, 2, 2, 45, tzinfo=dt.UTC)) == "20261202T024500Z"


def test_write_csv_keeps_only_the_fields(tmp_path):
    path = harness.write_csv(tmp_path / "r.csv", [{"a": 1, "b": 2, "c": 3}], ["a", "b"])
    assert path.read_text().splitlines() == ["a,b", "1,2"]


def test_write_json_is_atomic_and_makes_the_folder(tmp_path):
    path = tmp_path / "new" / "r.json"
    harness.write_json(path, {"x": 1, "p": Path("/a")})
    assert json.loads(path.read_text()) == {"x": 1, "p": "/a"}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left
    with pytest.raises(TypeError):
        harness.write_atomic(path, None)  # a failed write keeps the old file
    assert json.loads(path.read_text())["x"] == 1


def test_git_commit_of_a_tree_exported_without_history_reads_its_commit_file(tmp_path):
    # scripts/device-carry exports HEAD with a COMMIT file and no .git: results written on
    # the GPU host name their commit through it (they recorded None before).
    import importlib.util
    import shutil

    (tmp_path / "bench").mkdir()
    shutil.copy(Path(harness.__file__), tmp_path / "bench" / "harness.py")
    spec = importlib.util.spec_from_file_location(
        "exported_harness", tmp_path / "bench" / "harness.py"
    )
    exported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exported)
    assert exported.git_commit() is None  # no history, no COMMIT
    (tmp_path / "COMMIT").write_text("ab" * 20 + "\n")
    assert exported.git_commit() == "ab" * 20
    (tmp_path / "COMMIT").write_text("HEAD")
    assert exported.git_commit() is None
