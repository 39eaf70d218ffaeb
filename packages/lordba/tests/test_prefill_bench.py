"""bench/lordba.py --smoke on the CPU (Triton interpreter): the fused, unfused and GEMM-epilogue
LoRDBA paths side by side in the check, prefill and whole-model sections, over a plain and
quantized bases. Times on the CPU mean nothing; what is checked is that every variant runs,
takes the path it is named for, and that the paths agree."""

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchao")

_BENCH = Path(__file__).resolve().parents[3] / "bench"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))  # the script imports bench/harness.py as `harness`
harness = importlib.import_module("harness")
bench = harness.load("lordba")  # importing it runs nothing


def test_smoke_measures_fused_and_unfused_over_quantized_bases(tmp_path):
    argv = ["--smoke", "--sections", "check,prefill,model", "--tokens", "8"]
    argv += ["--model-bases", "plain,int8,loka_fp8", "--budget-s", "600", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    (result,) = tmp_path.glob("lordba_smoke_*.json")
    record = json.loads(result.read_text())
    assert sorted(p.name.split("_")[1] for p in tmp_path.glob("*.csv")) == ["model", "prefill"]
    results = record["results"]

    assert all(r["ok"] for r in results["check"])
    assert all(r["errors"]["inference_opaque_fused"] < 1e-5 for r in results["check"])
    for r in results["check"]:  # the GEMM-epilogue path, bf16, plain and FP8 bases
        assert r["epilogue_paths"] == {"epilogue": "gemm_epilogue", "epilogue_fp8": "gemm_epilogue"}
        assert r["epilogue_max_rel_error"] <= 2e-2

    paths = {r["variant"]: r.get("path") for r in results["prefill"]}
    assert paths["lordba"] == "addmm" and paths["lordba_fused"] == "addmm_fused"
    assert paths["lordba_opaque_base"] == "base"
    assert paths["lordba_opaque_base_fused"] == "base_fused"
    assert paths["lordba_epilogue"] == paths["lordba_fp8_epilogue"] == "gemm_epilogue"
    assert paths["lordba_fp8_fused"] == "base_fused"
    assert all(r["eager_ms"] > 0 for r in results["prefill"])
    own = {r["variant"]: r.get("own_base") for r in results["prefill"] if r["M"] == 8}
    assert own["lordba_epilogue"] == "base_epilogue"
    assert own["lordba_fp8_epilogue"] == "base_fp8_epilogue"

    model = {(r["base_kind"], r["variant"]): r for r in results["model"]}
    # plain and loka_fp8 add the epilogue kernel's base-only mode and the epilogue variant.
    assert len(model) == 16 and not any("error" in r or "skipped" in r for r in model.values())
    for kind, unfused, fused in [
        ("plain", "addmm", "addmm_fused"),
        ("int8", "base", "base_fused"),
        ("loka_fp8", "base", "base_fused"),
    ]:
        adapters = model[kind, "lordba_fused"]["adapters"]
        assert adapters == 7  # q, k, v, o, gate, up, down of the one layer
        assert model[kind, "lordba_unfused"]["paths"] == {unfused: adapters}
        assert model[kind, "lordba_fused"]["paths"] == {fused: adapters}
        assert model[kind, "lordba_fused"]["rel_error_vs_unfused"] < 1e-5
        assert model[kind, "lordba_fused"]["rel_change_vs_base"] > 0.01  # the adapters act
        assert model[kind, "lordba_fused"]["eager_vs_base"] > 0
        assert model[kind, "lordba_dense"]["paths"] == {"dense": adapters}
        assert model[kind, "lordba_dense"]["rel_error_vs_unfused"] < 1e-5
    for kind, fallback in [("plain", "addmm_fused"), ("loka_fp8", "base_fused")]:
        epilogue = model[kind, "lordba_epilogue"]
        # float32 on the CPU: the GEMM-epilogue path takes bf16/fp16 only, so it falls back.
        assert epilogue["paths"] == {fallback: 7}
        assert epilogue["rel_error_vs_unfused"] < 1e-5
        assert epilogue["own_base"] == "base_epilogue" and epilogue["eager_vs_own_base"] > 0
        assert "paths" not in model[kind, "base_epilogue"]
    summary = record["summary"]
    assert summary["model_max_rel_error_fused_vs_unfused"] < 1e-5
    assert set(summary["model_overhead"]) == {
        f"{kind} M=16 {variant}"
        for kind in ("plain", "int8", "loka_fp8")
        for variant in ("lordba_unfused", "lordba_fused", "lordba_dense")
    } | {
        f"{kind} M=16 {variant}"
        for kind in ("plain", "loka_fp8")
        for variant in ("base_epilogue", "lordba_epilogue")
    }


def test_compile_check_script_runs_every_case_on_the_cpu(tmp_path):
    """bench/lordba_compile.py on the CPU (interpreted kernels eager, aot_eager compiled): each
    base and mode compiles in one graph, agrees with eager, and trains no zero gradient."""
    script = harness.load("lordba_compile")
    assert script.main(["--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("lordba_compile_*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {(r["base"], r["train"]) for r in rows} == {
        (b, t) for b in ("plain", "fp8") for t in (False, True)
    }
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["graph_breaks"] == 0 and row["unique_graphs"] == 1
        assert row["out_rel_err"] < 2e-2 and not row["zero_grads"]
        if row["train"]:
            assert row["grad_rel_err"] < 2e-2
