"""Plans per execution mode: compiled plans take only traceable backends (torch.native),
eager plans the others, and an eager plan charges each pass its measured host time."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import sys

import polars as pl
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the planner tests' table builders
from test_dispatch_planner import (
    BF16_ROWS,
    ROW,
    bench_table,
    errors_table,
    plan_rows,
    sites_table,
)

from loka.dispatch.bench.host import host_overhead_ms
from loka.dispatch.bench.runner import mode_backends
from loka.dispatch.planner import PlanConfig, make_plan
from loka.dispatch.planner.config import MODES
from loka.schema import PASSES

SITES = sites_table(("fc", 1024, 4096, 8192, 0.5))
ERRORS = errors_table([("fc", ROW, p, 0.01, "safe") for p in PASSES])
# Both backends run the rowwise recipe at 0.6 ms per pass against bf16's 1.0 ms.
TIMED = bench_table(
    BF16_ROWS
    + [("torch.scaled_mm", ROW, p, 0.5, 0.1) for p in PASSES]
    + [("torch.native", ROW, p, 0.5, 0.1) for p in PASSES]
)


def test_each_mode_takes_its_own_backends():
    for mode, want in (("eager", "torch.scaled_mm"), ("compiled", "torch.native"),
                       ("cudagraphs", "torch.native")):  # fmt: skip
        rows = plan_rows(make_plan(SITES, ERRORS, TIMED, PlanConfig(mode=mode)))
        assert {r["backend"] for r in rows.values()} == {want}, mode
    rejected = plan_rows(make_plan(SITES, ERRORS, TIMED, PlanConfig(mode="compiled")))
    assert "only traceable backends" in str(rejected["fwd"]["rejected"])


def test_mode_backends_split_the_registry():
    compiled, eager = set(mode_backends("compiled")), set(mode_backends("eager"))
    assert compiled & eager == {"torch.bf16"}
    assert "torch.native" in compiled and "triton.fp8" in eager
    # The baseline as inductor pads an unaligned matmul: a compiled model's only.
    assert "inductor.bf16" in compiled and "inductor.bf16" not in eager


def test_a_compiled_plan_beats_the_padded_bf16_baseline_an_eager_plan_the_plain_one():
    # At an unaligned K bf16 unpadded takes 1.0 ms per pass, padded as inductor runs it 0.55:
    # FP8 at 0.6 wins in eager and loses compiled, and the plan's bf16 time says which.
    unaligned = sites_table(("fc", 1003, 4096, 8192, 0.5))
    padded = bench_table(
        BF16_ROWS
        + [("inductor.bf16", "bf16", p, 0.55, 0.0) for p in PASSES]
        + [("torch.scaled_mm", ROW, p, 0.5, 0.1) for p in PASSES]
        + [("torch.native", ROW, p, 0.5, 0.1) for p in PASSES],
        K=1003,
    )
    compiled = plan_rows(make_plan(unaligned, ERRORS, padded, PlanConfig(mode="compiled")))
    assert {r["recipe"] for r in compiled.values()} == {"bf16"}
    assert {r["bf16_ms"] for r in compiled.values()} == {0.55}
    eager = plan_rows(make_plan(unaligned, ERRORS, padded, PlanConfig(mode="eager")))
    assert {r["recipe"] for r in eager.values()} == {ROW}
    assert {r["bf16_ms"] for r in eager.values()} == {1.0}
    # Slower padded than plain (padding is not always faster): the plain row stands.
    slower = padded.with_columns(
        pl.when(pl.col("backend") == "inductor.bf16").then(2.0).otherwise(pl.col("median_ms"))
        .alias("median_ms")
    )  # fmt: skip
    compiled = plan_rows(make_plan(unaligned, ERRORS, slower, PlanConfig(mode="compiled")))
    assert {r["recipe"] for r in compiled.values()} == {ROW}
    assert {r["bf16_ms"] for r in compiled.values()} == {1.0}


def test_eager_plan_charges_host_time():
    host = TIMED.with_columns(
        pl.when(pl.col("backend") == "torch.scaled_mm").then(0.5).otherwise(0.0).alias("host_ms")
    )
    rows = plan_rows(make_plan(SITES, ERRORS, host, PlanConfig(mode="eager")))
    # 0.6 ms on the device + 0.5 ms on the host loses to bf16's 1.0 ms: every pass stays bf16.
    assert {r["recipe"] for r in rows.values()} == {"bf16"}
    # A compiled plan pays no host time per pass (and the native rows carry none).
    rows = plan_rows(make_plan(SITES, ERRORS, host, PlanConfig(mode="compiled")))
    assert {r["recipe"] for r in rows.values()} == {ROW}
    # A step bound by the device hides the host work: charge_host=False plans on device time.
    rows = plan_rows(make_plan(SITES, ERRORS, host, PlanConfig(mode="eager", charge_host=False)))
    assert {(r["recipe"], r["backend"]) for r in rows.values()} == {(ROW, "torch.scaled_mm")}


def test_host_overhead_is_zero_where_nothing_runs_on_the_host():
    assert host_overhead_ms("torch.bf16", "bf16", "fwd", 64, 64, "cpu") == 0.0
    assert host_overhead_ms("torch.native", ROW, "wgrad", 64, 64, "cpu") == 0.0


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        PlanConfig(mode="jit")


def test_a_model_with_no_linear_site_gets_an_empty_plan():
    plan = make_plan(SITES.head(0), ERRORS, TIMED, PlanConfig(mode="compiled"))
    assert plan.table.height == 0 and "site" in plan.table.columns
    assert any("nothing to plan" in line for line in plan.summary.lines())


def test_the_summary_names_sites_the_bench_left_unmeasured():
    # Only bf16 rows at this shape: the probed FP8 recipe has no kernel_bench row.
    bf16_only = TIMED.filter(pl.col("backend") == "torch.bf16")
    plan = make_plan(SITES, ERRORS, bf16_only, PlanConfig(mode="compiled"))
    assert any("left unmeasured" in line and "fc" in line for line in plan.summary.lines())
    measured = make_plan(SITES, ERRORS, TIMED, PlanConfig(mode="compiled"))
    assert not any("left unmeasured" in line for line in measured.summary.lines())


def test_a_recipe_no_backend_of_the_mode_runs_is_not_called_unmeasured():
    # torch.native (the compiled plans' backend) runs dynamic scaling only: a probed delayed
    # recipe without a row is refused for the mode, which more benchmarking cannot change.
    delayed = errors_table([("fc", "e4m3:e4m3/tensor/delayed16", p, 0.01, "safe") for p in PASSES])
    bf16_only = TIMED.filter(pl.col("backend") == "torch.bf16")
    plan = make_plan(SITES, delayed, bf16_only, PlanConfig(mode="compiled"))
    assert not any("left unmeasured" in line for line in plan.summary.lines())
    assert plan.fp8_sites() == []


def test_compiled_plans_charge_a_wgrad_its_quantization_as_the_step_pays_it():
    # Every pass needs 1.05x in every mode. A compiled wgrad's transposed quantizations are
    # charged at 1.9x their standalone time (measured 1-3x in place): a wgrad whose time is
    # mostly quantization (0.6 + 0.3 ms standalone, 1.11x) loses compiled (0.6 + 0.57 =
    # 1.17 ms) and wins eager, where nothing is charged.
    heavy = bench_table(
        BF16_ROWS
        + [("torch.scaled_mm", ROW, p, 0.6, 0.3) for p in PASSES]
        + [("torch.native", ROW, p, 0.6, 0.3) for p in PASSES]
    )
    for mode in MODES:
        assert {p: PlanConfig(mode=mode).margin(p) for p in PASSES} == dict.fromkeys(PASSES, 1.05)
    assert PlanConfig().wgrad_quant_charge() == 1.0
    assert PlanConfig(mode="compiled").wgrad_quant_charge() == 1.9
    assert PlanConfig(mode="compiled", min_speedup=1.2).margin("fwd") == 1.2
    eager = plan_rows(make_plan(SITES, ERRORS, heavy, PlanConfig(mode="eager")))
    assert {r["recipe"] for r in eager.values()} == {ROW}
    # eager: x and dY quantized once for fwd/dgrad and wgrad, credited to the wgrad
    assert eager["wgrad"]["predicted_ms"] == pytest.approx(0.6)
    assert "charged" not in eager["wgrad"]["reason"]
    for mode in ("compiled", "cudagraphs"):
        rows = plan_rows(make_plan(SITES, ERRORS, heavy, PlanConfig(mode=mode)))
        assert {p: rows[p]["recipe"] for p in PASSES} == {"fwd": ROW, "dgrad": ROW,
                                                        "wgrad": "bf16"}, mode  # fmt: skip
        assert "slower than bf16: 1.17 ms vs 1 ms" in str(rows["wgrad"]["rejected"]), mode
        assert "charged at 1.9x its standalone time" in str(rows["wgrad"]["rejected"]), mode
    # The charge is the user's to set: at 1.0 the standalone timing stands.
    asked = PlanConfig(mode="compiled", wgrad_quant_factor=1.0)
    assert {r["recipe"] for r in plan_rows(make_plan(SITES, ERRORS, heavy, asked)).values()} == {
        ROW
    }
    # A wgrad whose GEMM dominates still pays charged (0.5 + 1.9 x 0.1 = 0.69 ms, 1.45x), and
    # the plan predicts the charged time (a compiled plan shares no quantization).
    deep = bench_table(BF16_ROWS + [("torch.native", ROW, p, 0.5, 0.1) for p in PASSES])
    rows = plan_rows(make_plan(SITES, ERRORS, deep, PlanConfig(mode="compiled")))
    assert rows["wgrad"]["recipe"] == ROW
    assert rows["wgrad"]["predicted_ms"] == pytest.approx(0.69)
    assert rows["fwd"]["predicted_ms"] == pytest.approx(0.6)
    assert (
        "charged at 1.9x its standalone time, as the compiled step pays it"
        in rows["wgrad"]["reason"]
    )
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="wgrad_quant_factor must be >= 1"):
            PlanConfig(mode="compiled", wgrad_quant_factor=bad)


def test_fast_accumulation_is_a_compiled_backend_taken_only_when_allowed():
    assert "torch.native.fast" in mode_backends("compiled")
    fast = bench_table(BF16_ROWS + [("torch.native.fast", ROW, p, 0.4, 0.1) for p in PASSES]
                       + [("torch.native", ROW, p, 0.5, 0.1) for p in PASSES])  # fmt: skip
    rows = plan_rows(make_plan(SITES, ERRORS, fast, PlanConfig(mode="compiled")))
    assert {r["backend"] for r in rows.values()} == {"torch.native"}
    allowed = PlanConfig(mode="compiled", allow_fast_accum=True)
    rows = plan_rows(make_plan(SITES, ERRORS, fast, allowed))
    assert {r["backend"] for r in rows.values()} == {"torch.native.fast"}


def test_exclude_takes_a_site_or_one_pass_of_it():
    config = PlanConfig(exclude=("f*/wgrad", "head.*"))
    assert config.excluded("fc", "wgrad") and not config.excluded("fc", "fwd")
    assert (
        not config.excluded("fc") and config.excluded("head.0") and config.excluded("head.0", "fwd")
    )
    rows = plan_rows(
        make_plan(SITES, ERRORS, TIMED, PlanConfig(mode="compiled", exclude=("fc/wgrad",)))
    )
    assert [rows[p]["recipe"] for p in PASSES] == [ROW, ROW, "bf16"]
    assert "excluded by PlanConfig.exclude" in str(rows["wgrad"]["rejected"])
    with pytest.raises(ValueError, match="names no pass"):
        PlanConfig(exclude=("fc/backward",))


def test_force_plans_a_safe_fp8_pass_that_the_bench_times_slower_than_bf16():
    # The bench times each quantization standalone; under compile inductor may fuse it into
    # the op that makes the input, so a pass the bench calls slower can win in place: force
    # plans it (safe candidates only) for verification on the real step to judge.
    slower = bench_table(BF16_ROWS + [("torch.native", ROW, p, 0.9, 0.3) for p in PASSES])
    unsafe = errors_table([("fc", ROW, p, 0.5 if p == "wgrad" else 0.01,
                            "unsafe" if p == "wgrad" else "safe") for p in PASSES])  # fmt: skip
    plain = plan_rows(make_plan(SITES, ERRORS, slower, PlanConfig(mode="compiled")))
    assert {r["recipe"] for r in plain.values()} == {"bf16"}
    config = PlanConfig(mode="compiled", force=("f*/fwd", "fc/wgrad"))
    assert config.forced("fc", "fwd") and not config.forced("fc", "dgrad")
    rows = plan_rows(make_plan(SITES, unsafe, slower, config))
    # fwd forced; dgrad not forced (and not faster enough); wgrad forced but unsafe
    assert [rows[p]["recipe"] for p in PASSES] == [ROW, "bf16", "bf16"]
    assert rows["fwd"]["reason"].startswith("FP8 forced (PlanConfig.force)")
    assert "bf16 is faster" in str(rows["fwd"]["rejected"])
    assert rows["fwd"]["predicted_speedup"] < 1.0  # the plan says what it expects
    both = PlanConfig(mode="compiled", force=("fc",), exclude=("fc/fwd",))
    assert not both.forced("fc", "fwd") and both.forced("fc", "dgrad")  # exclude wins
    with pytest.raises(ValueError, match="force: 'fc/backward' names no pass"):
        PlanConfig(force=("fc/backward",))


def test_the_padded_baseline_is_a_candidate_only_where_dims_are_unaligned():
    from loka.dispatch.bench.candidates import candidates

    def baselines(K: int) -> set[str]:
        return {s.candidate.backend for s in candidates(8192, K, 4096) if s.candidate.is_bf16}

    assert baselines(1024) == {"torch.bf16"}
    assert baselines(1003) == {"torch.bf16", "inductor.bf16"}


def test_a_compiled_plan_notes_fp8_sites_whose_token_count_varies():
    jagged = SITES.with_columns(pl.lit(4000).alias("M_min"), pl.lit(9000).alias("M_max"))
    compiled = make_plan(jagged, ERRORS, TIMED, PlanConfig(mode="compiled")).summary.notes
    assert any("saw their token count M vary (fc)" in n for n in compiled)
    for sites, mode in ((SITES, "compiled"), (jagged, "eager")):
        notes = make_plan(sites, ERRORS, TIMED, PlanConfig(mode=mode)).summary.notes
        assert not any("token count M vary" in n for n in notes), mode


def test_a_plan_names_the_sites_whose_token_count_varies_and_apply_marks_them():
    import json

    from torch import nn

    from loka.dispatch import apply

    jagged = SITES.with_columns(pl.lit(4000).alias("M_min"), pl.lit(9000).alias("M_max"))
    for sites, want in ((SITES, []), (jagged, ["fc"])):
        plan = make_plan(sites, ERRORS, TIMED, PlanConfig(mode="compiled"))
        assert json.loads(plan.metadata["tokens_vary"]) == want
        K, N = sites.row(0, named=True)["K"], sites.row(0, named=True)["N"]
        model = nn.Sequential()
        model.add_module("fc", nn.Linear(K, N))
        applied = apply(model, plan)
        assert applied.sites == ["fc"]
        assert model.fc.fp8_config.tokens_vary is bool(want)
    # A plan saved before the key existed: no site marked (one-stage amax, as then).
    del plan.metadata["tokens_vary"]
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(K, N))
    apply(model, plan)
    assert model.fc.fp8_config.tokens_vary is False
