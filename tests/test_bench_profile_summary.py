"""bench/profile_summary.py on the recorded Wukong xl profiles: the kernel rows it groups."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def test_every_fp8_operand_pairing_is_an_fp8_gemm():
    kind = _load().kind
    for name in ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT",
                 "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT",
                 "nvjet_sm90_rqtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT"):  # fmt: skip
        assert kind(name) == "fp8 gemm", name
    assert kind("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NTN") == "bf16 gemm"
    assert kind("triton_red_fused_abs_amax_3") == "triton w/ quant"


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


def test_the_prediction_in_parts_from_the_recorded_hstu_run(capsys):
    # HSTU xl (realized_20261203T085405Z): its plan's FP8 passes as the bench timed them
    # against the bf16 and LoKA profiles of the same run.
    run = ROOT / "bench/results/realized_20261203T085405Z.json"
    profiles = ROOT / "bench/results/realized_20261203T085405Z_profiles"
    timings = ROOT / "bench/results/kernel_bench_xl_h200_20261203T0556Z.parquet"
    summary = _load()
    planned = summary.planned_parts(str(run), None, str(timings))
    # 34 passes: their bf16 time is the plan's own rows' sum; the FP8 time splits in two
    assert planned["bf16"] == pytest.approx(74.98, abs=0.01)
    assert planned["fp8 gemm"] + planned["quant"] == pytest.approx(50.56, abs=0.01)
    summary.main(["--diff", str(profiles / "profile_hstu_compiled_bf16.txt"),
                  str(profiles / "profile_hstu_compiled_loka.txt"), "--plan", str(run),
                  "--kernel-bench", str(timings)])  # fmt: skip
    out = capsys.readouterr().out
    # Its uvqk wgrad GEMMs take dY in e5m2 (`qrtst` kernels): FP8 GEMMs, not bf16 ones (read
    # as bf16 until 12-03, the bench seemed to time GEMMs 21-27% slower than the step).
    assert "bf16 GEMMs replaced       74.98 ->    67.77  (timed/step 1.11)" in out
    assert "FP8 GEMMs                 40.36 ->    37.49  (timed/step 1.08)" in out
    assert "saving                    24.42 ->    15.35" in out


def test_a_plan_needs_its_profiles_and_timings(capsys):
    with pytest.raises(SystemExit):
        _load().main(["x.txt", "--plan", "run.json"])
    assert "--plan needs --diff BASE" in capsys.readouterr().err


def test_plan_rows_find_their_timing_by_speed_key():
    # InterFormer xl's plan (realized_20261203T110458Z) takes pow2 recipes, timed under
    # their speed key (e4m3:e4m3/row/dynamic): the parts still add up to the plan's times.
    run = ROOT / "bench/results/realized_20261203T110458Z.json"
    timings = ROOT / "bench/results/kernel_bench_xl_h200_20261203T0556Z.parquet"
    planned = _load().planned_parts(str(run), "auto", str(timings))
    assert planned["bf16"] == pytest.approx(25.74, abs=0.01)
    assert planned["fp8 gemm"] == pytest.approx(13.66, abs=0.01)
    with pytest.raises(SystemExit, match="3 plans match None"):
        _load().planned_parts(str(run), None, str(timings))


def test_fused_attention_is_its_own_kind_and_top_lists_the_largest_families(capsys):
    summary = _load()
    for name in ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128",
                 "fmha_cutlassB_bf16_aligned_64x64_k64_sm80",
                 "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>"):  # fmt: skip
        assert summary.kind(name) == "attention", name
    assert summary.kind("cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nt_align1") == "bf16 gemm"
    table = ROOT / "bench/results/realized_20261203T220217Z_profiles/profile_interformer_compiled_bf16.txt"  # fmt: skip
    summary.main([str(table), "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["attention", "24.94", "ms/step"] for line in out)
    listed = out[out.index("   largest 3 kernel families:") + 1 :]
    assert len(listed) == 3 and "cudnn_generated_fort_native_sdpa" in listed[0]
    assert listed[0].split()[0] == "15.33"  # the attention backward, the largest kernel
