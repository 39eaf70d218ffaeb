"""bench/mods.py's pure parts: importing it runs nothing; arguments, the summary of rows
and the aim against torchao (CPU, no benchmark run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

mods_bench = harness.load("mods")  # importing it runs nothing


def test_import_ran_nothing_and_arguments_are_parsed_in_main():
    assert mods_bench.ROWS == [] and mods_bench.MODE == "full"
    args = mods_bench.parse_args(["--smoke", "--budget-s", "5", "--sections", "grouped"])
    assert args.smoke and args.budget_s == 5 and args.sections == "grouped"
    assert mods_bench.parse_args([]).budget_s == 170.0


def _row(impl, path, t_ms, shape="s", section="linear", train=True, ok=True):
    return {"section": section, "shape": shape, "path": path, "impl": impl, "t_ms": t_ms,
            "ok": ok, "train": train, "M": 8, "K": 16, "N": 32, "G": None}  # fmt: skip


def test_summary_takes_the_fastest_correct_path_of_each_kind(monkeypatch):
    rows = [
        _row("bf16", "F.linear", 2.0),
        _row("ours", "Fp8Linear row", 1.0),
        _row("ours", "Fp8Linear tensor", 0.5, ok=False),  # wrong: never the best
        _row("torchao", "torchao row", 1.6),
    ]
    monkeypatch.setattr(mods_bench, "ROWS", rows)
    (entry,) = mods_bench.summarize()["linear"]
    assert entry["ours_best"] == "Fp8Linear row" and entry["ours_vs_bf16"] == 2.0
    assert entry["torchao_vs_bf16"] == pytest.approx(1.25)
    aim = mods_bench.aims(mods_bench.summarize())["ahead_of_torchao_where_fp8_wins"]
    assert (aim["shapes"], aim["met"], aim["missed"]) == (1, 1, [])


def test_fmt_shows_missing_values_as_a_dash():
    assert mods_bench.fmt(None) == "-" == mods_bench.fmt(float("nan"))
    assert mods_bench.fmt(1.23456, 3) == "1.235"
