"""bench/producer_rows.py on the CPU (tiny shapes, wall clocks): each shape and recipe gets
the FP8 forward costed standalone and with x's quantization fused into its producer, by the
planner's arithmetic on the bench's own rows; a bad shape is refused in one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("producer_rows")


def test_each_recipe_is_costed_both_ways(tmp_path) -> None:
    assert script.main(["--out", str(tmp_path), "--device", "cpu"]) == 0
    (result,) = tmp_path.glob("producer_rows_*.json")
    data = json.loads(result.read_text())
    costed = data["costed"]
    assert [(r["kind"], r["recipe"]) for r in costed] == [
        (kind, recipe) for kind in ("norm", "pointwise") for recipe in script.RECIPES
    ]
    for r in costed:
        extra = max(r["op_quantize_ms"] - r["op_ms"], 0.0)
        rest = max(r["fp8_quant_ms"] - r["quantize_x_ms"], 0.0)
        assert r["fp8_in_graph_ms"] == pytest.approx(r["fp8_gemm_ms"] + rest + extra)
        assert r["speedup_in_graph"] == pytest.approx(r["bf16_ms"] / r["fp8_in_graph_ms"])
    assert not data["failed"] and data["meta"]["device"]


def test_a_shape_needs_dims_and_a_known_kind() -> None:
    assert script.parse_shapes("8x16x32:norm") == [(8, 16, 32, "norm")]
    with pytest.raises(argparse.ArgumentTypeError, match="is not MxKxN:kind"):
        script.parse_shapes("8x16:norm")
    with pytest.raises(argparse.ArgumentTypeError, match="kind must be one of"):
        script.parse_shapes("8x16x32:softmax")
