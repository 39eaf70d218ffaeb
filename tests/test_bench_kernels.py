"""bench/kernels.py's pure parts: importing it runs nothing; arguments and modes, the shapes
of each mode and the choice of the fastest correct tile (CPU, no benchmark run)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

kernels_bench = harness.load("kernels")  # importing it runs nothing


def test_import_ran_nothing_and_modes_come_from_the_arguments():
    assert kernels_bench.ROWS == [] and kernels_bench.MODE == "full"
    parse, mode_of = kernels_bench.parse_args, kernels_bench.mode_of
    assert mode_of(parse(["--smoke"])) == "smoke" and mode_of(parse(["--quick"])) == "quick"
    args = parse(["--M", "64,128", "--KN", "1024x4096", "--budget-s", "9"])
    assert mode_of(args) == "full" and args.budget_s == 9


def test_shapes_of_a_mode_and_their_overrides(monkeypatch):
    monkeypatch.setattr(kernels_bench, "MODE", "quick")
    monkeypatch.setattr(kernels_bench, "ARGS", kernels_bench.parse_args(["--KN", "64x32"]))
    chosen = kernels_bench.shapes()
    assert chosen["M"] == [8192] and chosen["KN"] == [(64, 32)]
    smoke, full = kernels_bench.tune_shapes("smoke"), kernels_bench.tune_shapes("full")
    assert set(smoke) == set(full) == {"rows", "transpose", "gemm", "grouped"}
    assert smoke["gemm"] == [(32, 128, 64)]


def _rows(*times, ok=True):
    return [{"ok": ok, "t_ms": t, "t_graph_ms": math.nan} for t in times]


def test_fastest_is_the_correct_variant_with_least_relative_time():
    variants = [
        ("a", _rows(1.0, 4.0)),  # 1 + 2 relative to the best at each shape
        ("b", _rows(2.0, 2.0)),  # 2 + 1: ties a; the first is kept
        ("c", _rows(0.5, 0.5, ok=False)),  # fastest but wrong
    ]
    assert kernels_bench._fastest(variants) == "a"
    assert kernels_bench._fastest([("c", _rows(1.0, ok=False))]) is None
    graph = {"ok": True, "t_ms": 9.0, "t_graph_ms": 3.0}
    assert kernels_bench._gpu_ms(graph) == 3.0  # a CUDA-graph time, where there is one
    assert kernels_bench._tile_dict((64, 32, 128, 4, 3))["BLOCK_N"] == 32
