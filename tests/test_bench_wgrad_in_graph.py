"""bench/wgrad_in_graph.py on the CPU (eager, tiny shapes): the variants it builds put
exactly their named passes in FP8, and its rows and profile tables are written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(BENCH))  # harness, as the script runs
    spec = importlib.util.spec_from_file_location("wgrad_in_graph", BENCH / "wgrad_in_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


def test_each_variant_puts_its_passes_in_fp8(script):
    from loka.mods import Fp8Linear

    model = script.block(16, 32, script.VARIANTS["plan+fc1.wgrad"], "cpu")
    assert isinstance(model.fc1, Fp8Linear) and isinstance(model.fc2, Fp8Linear)
    assert not model.fc1.fp8_config.wgrad.is_bf16 and model.fc2.fp8_config.wgrad.is_bf16
    assert all(not getattr(model.fc2.fp8_config, p).is_bf16 for p in ("fwd", "dgrad"))
    alone = script.block(16, 32, script.VARIANTS["fc1.wgrad"], "cpu")
    assert type(alone.fc2) is not Fp8Linear and alone.fc1.fp8_config.fwd.is_bf16
    assert type(script.block(16, 32, (), "cpu").fc1) is not Fp8Linear
    tensor = script.block(16, 32, script.VARIANTS["plan+wgrad.tensor"], "cpu")
    for linear in (tensor.fc1, tensor.fc2):
        assert linear.fp8_config.wgrad.recipe.granularity == "tensor"
        assert linear.fp8_config.fwd.recipe.granularity == "row"
    triton = script.block(16, 32, script.VARIANTS["triton+wgrad"], "cpu", backend="torch.scaled_mm")
    for linear in (triton.fc1, triton.fc2):
        assert {p.backend for p in linear.fp8_config.passes().values()} == {"torch.scaled_mm"}
    assert script.backend_of("triton") == "torch.scaled_mm" == script.backend_of("triton+wgrad")
    assert script.backend_of("plan+wgrad") == "torch.native"
    centered = script.block(16, 32, script.VARIANTS["plan+fc2.center"], "cpu")
    assert centered.fc2.fp8_config.fwd.recipe.center
    assert not centered.fc1.fp8_config.fwd.recipe.center
    assert not centered.fc2.fp8_config.dgrad.recipe.center


def test_main_writes_a_row_per_variant_with_its_speedup_and_profile(script, tmp_path):
    assert script.main(["--out", str(tmp_path), "--variants", "bf16,plan+wgrad,plan+wgrad.tensor,plan+center,triton", "--profile",
                        "--tokens", "32", "--dim", "16", "--hidden", "32"]) == 0  # fmt: skip
    (result,) = tmp_path.glob("wgrad_in_graph_*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "bf16",
        "plan+wgrad",
        "plan+wgrad.tensor",
        "plan+center",
    ]
    assert all(r["inductor"] == "default" for r in rows)
    meta = json.loads(result.read_text())["meta"]
    assert meta["skipped"] == ["triton: torch.scaled_mm needs a GPU"]
    assert rows[0]["speedup_vs_bf16"] == 1.0 and rows[1]["speedup_vs_bf16"] > 0
    assert len(rows[1]["fp8_passes"]) == 6 and not rows[0]["compiled"]
    (profiles,) = tmp_path.glob("wgrad_in_graph_*_profiles")
    assert sorted(p.name for p in profiles.iterdir()) == [
        "profile_bf16_default.txt",
        "profile_plan_center_default.txt",
        "profile_plan_wgrad.tensor_default.txt",
        "profile_plan_wgrad_default.txt",
    ]


def test_unknown_variants_are_refused_in_one_line(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--variants", "bf16,fc3.wgrad"])
    assert "unknown fc3.wgrad" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.parse_args(["--inductor", "mk,fast"])
    assert "--inductor: unknown fast" in capsys.readouterr().err
