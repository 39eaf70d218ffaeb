"""bench/bias_grad_layer.py on the CPU (a tiny HSTU layer, wall clocks): a row per variant with
its time and kernels, the bias-gradient forms give bf16's gradients, an FP8 variant runs, and
an unknown variant is refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script_module = harness.load("bias_grad_layer")  # importing it runs nothing


@pytest.fixture
def script():
    return script_module


def test_a_row_per_variant_and_the_bias_forms_keep_the_gradients(script, tmp_path):
    variants = "bf16,bf16+split,fp8+sum@mk"
    argv = ["--out", str(tmp_path), "--steps", "1", "--blocks", "1", "--variants", variants]
    assert script.main(argv) == 0
    (result,) = tmp_path.glob("bias_grad_layer_*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    assert all(r["ms"] > 0 and r["blocks_ms"] for r in rows)
    by_name = {r["variant"]: r for r in rows}
    assert "grad_rel_err" not in by_name["bf16"]
    assert by_name["bf16+split"]["grad_rel_err"] < 1e-5  # the same GEMMs, another sum order
    assert 0 < by_name["fp8+sum@mk"]["grad_rel_err"] < 0.3  # FP8 dgrad: close, not equal


def test_variants_and_their_options(script, capsys):
    assert script.split_variant("fp8w+split@mk") == ("fp8w+split", {"triton.multi_kernel": 1})
    assert script.split_variant("bf16@bf") == ("bf16", {"benchmark_fusion": True})
    with pytest.raises(ValueError, match="unknown variant 'bf16@xx'"):
        script.split_variant("bf16@xx")
    assert script.main(["--variants", "fp9+sum"]) == 2
    assert capsys.readouterr().out.strip().count("\n") == 0  # one line
