"""bench/profile_summary.py on the recorded Wukong xl profiles: the kernel rows it groups."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]
PROFILES = ROOT / "bench/results/profiles_wukong_xl_20261202T0618Z"


def _load():
    spec = importlib.util.spec_from_file_location(
        "profile_summary", ROOT / "bench/profile_summary.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_groups_the_fp8_gemms_only_in_the_fp8_profile():
    summary = _load()
    by_kind = {}
    for tag in ("bf16", "loka"):
        rows = summary.kernel_rows(str(PROFILES / f"profile_wukong_compiled_{tag}.txt"))
        assert rows and all(ms > 0 and calls > 0 for _, ms, calls in rows)
        by_kind[tag] = {summary.kind(name) for name, _, _ in rows}
    assert "fp8 gemm" in by_kind["loka"] and "triton w/ quant" in by_kind["loka"]
    assert "fp8 gemm" not in by_kind["bf16"] and "triton w/ quant" not in by_kind["bf16"]


def test_main_prints_a_line_per_kind(capsys):
    _load().main([str(PROFILES / "profile_wukong_compiled_loka.txt")])
    out = capsys.readouterr().out
    assert "listed kernels 64.54 ms/step" in out  # as recorded in summary.txt
    assert "fp8 gemm" in out


def test_diff_puts_the_plans_kernels_against_bf16s_by_kind_and_family(capsys):
    summary = _load()
    assert summary.family("triton_red_fused_amax_abs_10") == "triton_red_fused_amax_abs"
    bf16, loka = (str(PROFILES / f"profile_wukong_compiled_{t}.txt") for t in ("bf16", "loka"))
    lines = summary.diff_lines(bf16, loka, steps=4)
    fp8 = next(line for line in lines if line.strip().startswith("fp8 gemm"))
    assert "0.00 ->" in fp8 and "(+" in fp8  # FP8 GEMMs appear only in the plan's step
    grew = lines.index("   grew most:")
    assert lines.index("   shrank most:") > grew + 1  # families listed under each
    summary.main(["--diff", bf16, loka])
    assert "against" in capsys.readouterr().out
