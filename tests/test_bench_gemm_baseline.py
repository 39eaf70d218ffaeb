"""bench/gemm_baseline.py on the CPU (tiny shapes, wall clocks, no FP8 GEMM): every method
gives a row per pass, the FP8 column stays empty where `_scaled_mm` cannot run, and a bad
shape or pass is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gemm_baseline", BENCH / "gemm_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


def test_rows_per_method_and_pass(script, tmp_path):
    assert script.main(["--out", str(tmp_path), "--shapes", "32x16x24", "--calls", "2"]) == 0
    (result,) = tmp_path.glob("gemm_baseline_*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["pass"], r["method"]) for r in rows] == [
        (p, m) for p in script.PASSES for m in script.METHODS
    ]
    assert all(r["bf16_ms"] >= 0 and r["fp8_ms"] is None and r["speedup"] is None for r in rows)


def test_operands_are_the_pass_gemm(script):
    import torch

    fwd = script.operands(8, 4, 6, "fwd", "cpu")
    assert fwd["a"].shape == (8, 4) and fwd["b"].shape == (6, 4) and fwd["bias"].shape == (6,)
    wgrad = script.operands(8, 4, 6, "wgrad", "cpu")
    # dW = dY^T x: [N, M] @ ([K, M])^T, both transposed views as autograd hands them over
    assert wgrad["a"].shape == (6, 8) and wgrad["b"].shape == (4, 8)
    assert not wgrad["a"].is_contiguous() and not wgrad["b"].is_contiguous()
    out = script.gemm_calls(wgrad)["bf16"]()
    assert out.shape == (6, 4) and out.dtype == torch.bfloat16


def test_bad_input_is_one_line(script, capsys):
    with pytest.raises(ValueError, match="MxKxN"):
        script.shape_of("16384x2048")
    with pytest.raises(SystemExit):
        script.parse_args(["--passes", "fwd,dgrad"])
    assert "unknown 'dgrad'" in capsys.readouterr().err


def test_clocks_are_a_row_of_the_forward_and_absent_without_nvml(script, tmp_path):
    assert script.main(["--out", str(tmp_path), "--shapes", "32x16x24", "--calls", "2",
                        "--clocks"]) == 0  # fmt: skip
    (result,) = tmp_path.glob("gemm_baseline_*.json")
    rows = json.loads(result.read_text())["rows"]
    (clock_row,) = [r for r in rows if r["method"] == "clocks"]
    assert clock_row["pass"] == "fwd" and clock_row["clocks"] == {"bf16": None}
    assert script.clocks(lambda: None, "cpu") is None


def test_after_idle_is_one_more_method_only_when_asked(script, tmp_path):
    assert script.main(["--out", str(tmp_path), "--shapes", "32x16x24", "--calls", "2",
                        "--passes", "fwd", "--idle-s", "0.01"]) == 0  # fmt: skip
    (result,) = tmp_path.glob("gemm_baseline_*.json")
    data = json.loads(result.read_text())
    assert [r["method"] for r in data["rows"]] == [*script.METHODS, "after_idle"]
    assert data["meta"]["idle_s"] == 0.01 and data["rows"][-1]["bf16_ms"] >= 0
