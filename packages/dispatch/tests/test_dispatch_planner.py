"""The planner on hand-made tables: choices, reasons, shared quantization, error budget,
the end-to-end prediction, and invariants on random tables."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import itertools
import math

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loka.dispatch.planner import (
    PlanConfig,
    PlanSummary,
    batches_to_decide,
    make_plan,
    sites_fingerprint,
)
from loka.schema import PASSES, validate

DEVICE = {
    "device": "NVIDIA H200", "capability": "9.0", "driver": "d", "torch_version": "t",
    "triton_version": "r",
}  # fmt: skip
ROW, TENSOR, E5 = "e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic"


def sites_table(*sites: tuple[str, int, int, int, float | None]) -> pl.DataFrame:
    return validate(
        pl.DataFrame(
            [
                {"site": s, "kind": "linear", "K": k, "N": n, "M_min": m, "M_p50": m,
                 "M_max": m, "calls": 1, "groups": 1, "has_bias": False, "dtype": "bfloat16",
                 "fwd_ms": None, "bwd_ms": None, "time_share": share}
                for s, k, n, m, share in sites
            ],
            schema_overrides={"fwd_ms": pl.Float64, "bwd_ms": pl.Float64, "time_share": pl.Float64},
        ),
        "sites",
    )  # fmt: skip


def errors_table(rows: list[tuple[str, str, str, float, str]]) -> pl.DataFrame:
    """(site, recipe, pass, ucb, verdict) rows; budgets 0.06 fwd, 0.09 backward."""
    return validate(
        pl.DataFrame(
            [
                {"site": s, "recipe": r, "pass": p, "n": 8, "mean_rel_err": ucb * 0.9,
                 "std_rel_err": 0.001, "lcb_rel_err": ucb * 0.8, "ucb_rel_err": ucb,
                 "sqnr_db": 30.0, "max_abs_err": 0.1, "bf16_rel_err": 0.003,
                 "budget": 0.06 if p == "fwd" else 0.09, "confidence": 0.95,
                 "method": "student-t", "verdict": v, "emulated": True, "step_last": 9}
                for s, r, p, ucb, v in rows
            ]
        ),
        "site_errors",
    )  # fmt: skip


def bench_table(rows: list[tuple], M: int = 8192, K: int = 1024, N: int = 4096) -> pl.DataFrame:
    """(backend, recipe, pass, gemm_ms, quant_ms) rows at one shape."""
    return validate(
        pl.DataFrame(
            [
                {**DEVICE, "backend": b, "recipe": r, "pass": p, "M_bucket": M, "K": K, "N": N,
                 "groups": 1, "median_ms": g + q, "tflops": 1.0, "estimated": False,
                 "gemm_ms": g, "quant_ms": q}
                for b, r, p, g, q in rows
            ]
        ),
        "kernel_bench",
    )  # fmt: skip


BF16_ROWS = [("torch.bf16", "bf16", p, 1.0, 0.0) for p in PASSES]


def plan_rows(plan) -> dict[str, dict]:
    return {r["pass"]: r for r in plan.table.iter_rows(named=True)}


def test_fastest_safe_candidate_per_pass_with_every_rejection_explained() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    errors = errors_table(
        [("fc", ROW, "fwd", 0.04, "safe"), ("fc", TENSOR, "fwd", 0.08, "unsafe"),
         ("fc", ROW, "dgrad", 0.05, "safe"), ("fc", ROW, "wgrad", 0.05, "undecided"),
         ("fc", "e4m3:e4m3/block/dynamic", "fwd", 0.03, "safe")]
    )  # fmt: skip
    bench = bench_table(
        [*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.1), ("triton.fp8", ROW, "fwd", 0.7, 0.1), ("torch.scaled_mm.fast", ROW, "fwd", 0.3, 0.1), ("torch.scaled_mm", TENSOR, "fwd", 0.4, 0.1), ("torch.scaled_mm", ROW, "dgrad", 0.95, 0.1), ("torch.scaled_mm", ROW, "wgrad", 0.5, 0.2), ("torch.scaled_mm", E5, "dgrad", 0.2, 0.1)]
    )  # fmt: skip
    plan = make_plan(sites, errors, bench)
    rows = plan_rows(plan)
    fwd = rows["fwd"]
    assert (fwd["backend"], fwd["recipe"]) == ("torch.scaled_mm", ROW)
    assert fwd["predicted_ms"] == pytest.approx(0.6) and fwd["predicted_speedup"] == pytest.approx(
        1 / 0.6
    )
    assert fwd["predicted_rel_err"] == 0.04 and fwd["budget"] == 0.06
    reasons = {(r["backend"], r["recipe"]): r["reason"] for r in fwd["rejected"]}
    assert reasons[("torch.scaled_mm", TENSOR)].startswith("unsafe: error bound 0.08 > budget 0.06")
    assert "fast accumulation" in reasons[("torch.scaled_mm.fast", ROW)]
    assert "joint choice" in reasons[("triton.fp8", ROW)]
    assert "no kernel_bench row" in reasons[("*", "e4m3:e4m3/block/dynamic")]
    # dgrad: row costs 1.05 > bf16 1.0 -> bf16; e5m2 is fast but was never probed.
    dgrad = rows["dgrad"]
    assert dgrad["recipe"] == "bf16" and "no safe FP8 candidate is faster" in dgrad["reason"]
    dreasons = {(r["backend"], r["recipe"]): r["reason"] for r in dgrad["rejected"]}
    assert dreasons[("torch.scaled_mm", ROW)].startswith("slower than bf16: 1.05 ms vs 1 ms")
    assert "no error measurement" in dreasons[("torch.scaled_mm", E5)]
    wgrad = rows["wgrad"]
    assert wgrad["recipe"] == "bf16" and "undecided" in wgrad["rejected"][0]["reason"]
    # With permissive settings the planner takes the faster, riskier options.
    loose = plan_rows(
        make_plan(sites, errors, bench, PlanConfig(allow_fast_accum=True, allow_undecided=True))
    )
    assert loose["fwd"]["backend"] == "torch.scaled_mm.fast" and loose["wgrad"]["recipe"] == ROW


def test_shared_quantization_makes_the_backward_pair_worth_it() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    errors = errors_table([("fc", ROW, p, 0.04, "safe") for p in PASSES])
    # Standalone the wgrad (0.75 + 0.4) loses to bf16; with x and dY shared it costs 0.55.
    bench = bench_table(
        [*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.7, 0.2), ("torch.scaled_mm", ROW, "dgrad", 0.7, 0.2), ("torch.scaled_mm", ROW, "wgrad", 0.75, 0.4)]
    )  # fmt: skip
    rows = plan_rows(make_plan(sites, errors, bench))
    assert [rows[p]["recipe"] for p in PASSES] == [ROW] * 3
    assert rows["wgrad"]["predicted_ms"] == pytest.approx(0.75)
    assert "shared with other passes: 0.4 ms" in rows["wgrad"]["reason"]
    inference = plan_rows(make_plan(sites, errors, bench, PlanConfig(inference=True)))
    assert [inference[p]["recipe"] for p in PASSES] == [ROW, "bf16", "bf16"]
    assert "inference plan" in inference["dgrad"]["rejected"][0]["reason"]
    alone = plan_rows(make_plan(sites, errors, bench, PlanConfig(share_quantization=False)))
    assert alone["wgrad"]["recipe"] == "bf16" and alone["fwd"]["recipe"] == ROW
    # A margin demanded over bf16 applies to every FP8 pass.
    margin = plan_rows(make_plan(sites, errors, bench, PlanConfig(min_speedup=1.1)))
    assert [margin[p]["recipe"] for p in PASSES] == [ROW] * 3  # 1/0.9 = 1.11 >= 1.1
    # At 1.2 fwd and dgrad (1.11x) drop out, and the wgrad alone (1.15 ms) loses too.
    assert all(r["recipe"] == "bf16" for r in plan_rows(
        make_plan(sites, errors, bench, PlanConfig(min_speedup=1.2))).values())  # fmt: skip


def test_a_gemm_whose_quantization_costs_more_than_it_saves_has_no_unconstrained_gain() -> None:
    """InterFormer's sequence arm in small: the pre-quantized FP8 GEMM is twice as fast,
    but quantizing its inputs costs more than that, accurate or not."""
    sites = sites_table(("a", 1024, 4096, 8192, 0.4))
    errors = errors_table([("a", ROW, "fwd", 0.01, "safe")])
    bench = bench_table([*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.8)])
    summary = make_plan(sites, errors, bench).summary
    assert summary.passes_fp8 == 0 and summary.predicted_speedup == pytest.approx(1.0)
    assert summary.ceiling > 1.05  # the share-based ceiling counts the GEMM alone
    assert summary.unconstrained_speedup == pytest.approx(1.0)


def test_global_error_budget_moves_the_least_valuable_sites_back() -> None:
    sites = sites_table(("a", 1024, 4096, 8192, None), ("b", 1024, 4096, 8192, None))
    errors = errors_table([("a", ROW, "fwd", 0.05, "safe"), ("b", ROW, "fwd", 0.02, "safe")])
    bench = bench_table([*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.1)])
    free = make_plan(sites, errors, bench)
    assert free.table.filter(pl.col("pass") == "fwd")["recipe"].to_list() == [ROW, ROW]
    capped = make_plan(sites, errors, bench, PlanConfig(error_budget_total=0.03))
    fwd = {r["site"]: r for r in capped.table.filter(pl.col("pass") == "fwd").iter_rows(named=True)}
    assert fwd["a"]["recipe"] == "bf16" and fwd["b"]["recipe"] == ROW
    assert "global error budget" in fwd["a"]["reason"]
    assert any("global error budget" in n for n in capped.summary.notes)
    # Sensitivity weights decide which site pays.
    weighted = make_plan(sites, errors, bench,
                         PlanConfig(error_budget_total=0.05, sensitivity={"b": 10.0}))  # fmt: skip
    wf = {
        r["site"]: r["recipe"]
        for r in weighted.table.filter(pl.col("pass") == "fwd").iter_rows(named=True)
    }
    assert wf == {"a": ROW, "b": "bf16"}
    with pytest.raises(ValueError, match="min_speedup"):
        PlanConfig(min_speedup=0.5)


def test_summary_predicts_end_to_end_with_its_ceiling() -> None:
    sites = sites_table(("a", 1024, 4096, 8192, 0.3), ("b", 1024, 4096, 8192, 0.2))
    errors = errors_table([("a", ROW, "fwd", 0.04, "safe"), ("b", ROW, "fwd", 0.09, "unsafe")])
    bench = bench_table([*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.25)])
    summary = make_plan(sites, errors, bench).summary
    # a: (0.75 + 1 + 1) / 3 of its bf16 time; b stays bf16.
    assert summary.gemm_share == pytest.approx(0.5)
    assert summary.predicted_speedup == pytest.approx(1 / (0.5 + 0.3 * 2.75 / 3 + 0.2))
    assert summary.gemm_speedup == pytest.approx(6 / 5.75)
    # s: the pre-quantized GEMM (0.5) in fwd of both sites, safe or not.
    assert summary.prequant_speedup == pytest.approx(6 / 5.0)
    assert summary.ceiling == pytest.approx(1 / (0.5 + 0.5 / 1.2))
    assert 0 < summary.share_of_ceiling < 1
    # Over the safe candidates only, b's fwd GEMM counts at bf16's: s = 6 / 5.5.
    assert summary.safe_prequant_speedup == pytest.approx(6 / 5.5)
    assert summary.safe_ceiling == pytest.approx(1 / (0.5 + 0.5 / (6 / 5.5)))
    assert summary.predicted_speedup < summary.safe_ceiling < summary.ceiling
    assert any("safe candidates only" in line for line in summary.lines())
    # Every candidate allowed, quantization included: b's fwd too at 0.75.
    both = 1 / (0.5 + 0.3 * 2.75 / 3 + 0.2 * 2.75 / 3)
    assert summary.unconstrained_speedup == pytest.approx(both)
    assert summary.predicted_speedup < summary.unconstrained_speedup < summary.ceiling
    assert any("accurate or not, quantizations included" in line for line in summary.lines())
    assert summary.sites_fp8 == 1 and summary.passes_fp8 == 1 and not summary.estimated
    # From a measured bf16 step: g = the planned sites' bf16 kernel time (6 ms) over it.
    assert summary.bf16_gemm_ms == pytest.approx(6.0)
    summary.measured_bf16_step_ms = 8.0
    assert summary.gemm_share_from_step == pytest.approx(0.75)
    assert summary.ceiling_from_step == pytest.approx(1 / (0.25 + 0.75 / 1.2))
    assert summary.safe_ceiling_from_step == pytest.approx(1 / (0.25 + 0.75 / (6 / 5.5)))
    assert summary.ceiling_from_step > summary.ceiling  # g 0.75 of this step, 0.5 by Probe
    summary.measured_bf16_step_ms = (
        5.0  # GEMMs timed apart longer than the step: no ceiling claimed
    )
    assert summary.ceiling_from_step is None and summary.gemm_share_from_step is None
    # Derived, not stored: a summary read back (with a key an earlier version wrote) agrees.
    saved = {**summary.__dict__, "measured_bf16_step_ms": 8.0, "ceiling_from_step": None}
    restored = PlanSummary.from_dict(saved)
    assert restored.ceiling_from_step == pytest.approx(1 / (0.25 + 0.75 / 1.2))
    # A compiled plan says that Probe's eager share makes its prediction low; eager not.
    assert not any("comes from eager steps" in n for n in summary.notes)
    compiled = make_plan(sites, errors, bench, PlanConfig(mode="compiled")).summary
    assert any("comes from eager steps" in n for n in compiled.notes)
    untimed = make_plan(
        sites.with_columns(pl.lit(None, pl.Float64).alias("time_share")), errors, bench
    )
    assert untimed.summary.predicted_speedup is None
    assert any("not predicted" in line for line in untimed.summary.lines())
    given_g = make_plan(sites.with_columns(pl.lit(None, pl.Float64).alias("time_share")), errors,
                        bench, gemm_share=0.5).summary  # fmt: skip
    assert given_g.predicted_speedup == pytest.approx(1 / (0.5 + 0.5 * 5.75 / 6))


def test_sites_without_timings_stay_bf16_and_metadata_fingerprints_the_model() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None), ("tiny", 13, 7, 8192, None))
    errors = errors_table([("fc", ROW, "fwd", 0.04, "safe"), ("tiny", ROW, "fwd", 0.01, "safe")])
    bench = bench_table([*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.1)])
    plan = make_plan(sites, errors, bench)
    tiny = plan.table.filter(pl.col("site") == "tiny")
    assert set(tiny["recipe"]) == {"bf16"} and tiny["reason"][0].startswith("stays bf16: no bf16")
    assert math.isnan(tiny["bf16_ms"][0])
    assert plan.metadata["model_fingerprint"] == sites_fingerprint(
        [("fc", 1024, 4096), ("tiny", 13, 7)]
    )
    assert plan.fp8_sites() == ["fc"]
    two_devices = pl.concat([bench, bench.with_columns(pl.lit("NVIDIA H100").alias("device"))])
    with pytest.raises(ValueError, match="several machines"):
        make_plan(sites, errors, two_devices)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    times=st.lists(st.tuples(st.floats(0.2, 2.0), st.floats(0.0, 0.5)), min_size=6, max_size=6),
    verdicts=st.lists(st.sampled_from(["safe", "unsafe", "undecided"]), min_size=6, max_size=6),
)
def test_plan_invariants_on_random_tables(times, verdicts) -> None:
    recipes = [ROW, TENSOR]
    sites = sites_table(("fc", 1024, 4096, 8192, 0.5))
    errors = errors_table(
        [("fc", r, p, 0.04, verdicts[i * 2 + j]) for i, p in enumerate(PASSES) for j, r in enumerate(recipes)]
    )  # fmt: skip
    bench = bench_table(
        BF16_ROWS
        + [("torch.scaled_mm", r, p, *times[i * 2 + j]) for i, p in enumerate(PASSES) for j, r in enumerate(recipes)]
    )  # fmt: skip
    plan = make_plan(sites, errors, bench)
    rows = plan_rows(plan)
    total = 0.0
    for p in PASSES:
        r = rows[p]
        total += r["predicted_ms"]
        if r["recipe"] != "bf16":  # never unsafe, never slower than bf16
            assert verdicts[PASSES.index(p) * 2 + recipes.index(r["recipe"])] == "safe"
            assert r["predicted_ms"] * 1.05 < r["bf16_ms"]
        assert len(r["rejected"]) == 2  # every other candidate, bf16 included, with a reason
    # Brute force: no valid combination of safe candidates is faster.
    opts = {p: [("bf16", 1.0, 0.0)] + [
        (r, *times[i * 2 + j]) for j, r in enumerate(recipes) if verdicts[i * 2 + j] == "safe"
    ] for i, p in enumerate(PASSES)}  # fmt: skip
    best = 3.0
    for combo in itertools.product(*opts.values()):
        eff = [g + q for _, g, q in combo]
        (fr, _, fq), (dr, _, dq), (wr, _, _) = combo
        credit = (fq if wr != "bf16" and fr == wr else 0) + (dq if wr != "bf16" and dr == wr else 0)
        eff[2] -= min(credit, combo[2][2])
        if all(r == "bf16" or e * 1.05 < 1.0 for (r, _, _), e in zip(combo, eff, strict=True)):
            best = min(best, sum(eff))
    assert total == pytest.approx(best)
    assert plan.summary.predicted_speedup >= 1.0 - 1e-12


def test_a_norm_fed_site_weighs_fusing_its_norm() -> None:
    from loka.dispatch.testing import synthetic_kernel_bench

    sites = sites_table(("fc", 1024, 4096, 8192, None))
    errors = errors_table([("fc", ROW, p, 0.04, "safe") for p in PASSES])
    # FP8 at 0.97 ms (0.776 GEMM + 0.194 quantization) is not 5% faster than bf16 (1 ms)...
    bench = synthetic_kernel_bench([(8192, 1024, 4096)], fp8_ms=0.97, norm_shapes=[(8192, 1024)])
    assert all(r["recipe"] == "bf16" for r in plan_rows(make_plan(sites, errors, bench)).values())
    # ...but with the norm fused the forward pays 0.776 + (0.16 - 0.2) ms. Probe found that
    # norm "ln" feeds fc alone (sites.norm).
    fed = sites.with_columns(pl.lit("ln").alias("norm"))
    fused = plan_rows(make_plan(fed, errors, bench))["fwd"]
    assert fused["recipe"] == ROW and fused["fuse_norm"] and fused["norm"] == "ln"
    assert fused["predicted_ms"] == pytest.approx(0.97 * 0.8 - 0.04)
    assert "norm feeding it is fused" in fused["reason"]
    assert not plan_rows(make_plan(sites, errors, bench))["fwd"]["fuse_norm"]


def test_estimated_times_do_not_put_a_pass_in_fp8_on_a_measured_table() -> None:
    # Site a's shape was measured; site b's was left to the cost model when the bench budget
    # ran out (a GPU demo with 60 s of timing once planned such sites and ran 0.83x bf16).
    sites = sites_table(("a", 1024, 4096, 8192, None), ("b", 512, 512, 8192, None))
    errors = errors_table([(s, ROW, "fwd", 0.02, "safe") for s in ("a", "b")])
    fast = [*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.1)]
    measured = bench_table(fast)
    estimated = bench_table(fast, K=512, N=512).with_columns(pl.lit(True).alias("estimated"))
    mixed = pl.concat([measured, estimated])
    plan = make_plan(sites, errors, mixed)
    fwd = {r["site"]: r for r in plan.table.iter_rows(named=True) if r["pass"] == "fwd"}
    # Its FP8 choice was measured: the plan is not labelled ESTIMATED, a note says what is.
    assert not plan.summary.estimated
    assert any("baseline time(s) are estimates" in n for n in plan.summary.notes)
    assert fwd["a"]["recipe"] == ROW and fwd["b"]["recipe"] == "bf16"
    assert "ESTIMATED, not measured" in fwd["b"]["rejected"][0]["reason"]
    # All estimated (planning for an absent GPU), or allowed explicitly: estimates count.
    only_estimates = make_plan(sites, errors, mixed.with_columns(pl.lit(True).alias("estimated")))
    assert only_estimates.summary.estimated
    assert {
        r["recipe"] for r in only_estimates.table.iter_rows(named=True) if r["pass"] == "fwd"
    } == {ROW}
    allowed = make_plan(sites, errors, mixed, PlanConfig(allow_estimated=True))
    assert {r["recipe"] for r in allowed.table.iter_rows(named=True) if r["pass"] == "fwd"} == {ROW}


def _errors(n: int, mean: float, std: float, verdict: str = "undecided") -> pl.DataFrame:
    rows = [
        {"site": "fc", "recipe": ROW, "pass": p, "n": n, "mean_rel_err": mean,
         "std_rel_err": std, "lcb_rel_err": mean - std, "ucb_rel_err": mean + std,
         "sqnr_db": 30.0, "max_abs_err": 0.1, "bf16_rel_err": 0.003, "budget": 0.06,
         "confidence": 0.95, "method": "student-t", "verdict": verdict, "emulated": True,
         "step_last": n}
        for p in PASSES
    ]  # fmt: skip
    return validate(pl.DataFrame(rows), "site_errors")


def test_an_undecided_all_bf16_plan_says_so_and_how_many_batches_would_decide() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    bench = bench_table([*BF16_ROWS, *[("torch.scaled_mm", ROW, p, 0.5, 0.1) for p in PASSES]])
    plan = make_plan(sites, _errors(4, 0.05, 0.01), bench)
    assert plan.summary.sites_fp8 == 0
    text = plan.summary.undecided
    assert "3 FP8 candidate(s) refused as undecided after 4 sampled batch(es)" in text
    need = batches_to_decide({"n": 4, "mean_rel_err": 0.05, "std_rel_err": 0.01,
                              "budget": 0.06, "confidence": 0.95})  # fmt: skip
    assert need == 5  # (1.645 * 0.01 / 0.01)^2 = 2.7, but at least n + 1
    assert need is not None and f"about {need} sampled batches" in text
    assert any(text == line for line in plan.summary.lines())
    # Decided verdicts leave no such line.
    decided = make_plan(sites, _errors(8, 0.01, 0.001, "safe"), bench)
    assert decided.summary.sites_fp8 == 1 and decided.summary.undecided is None


def test_the_undecided_candidates_that_would_change_the_plan_are_named() -> None:
    """The summary names the undecided candidates a plan would take were they safe, what
    that plan predicts, and the batches that would decide them; undecided candidates that
    would change nothing (bf16 is faster) leave no such stakes."""
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    bench = bench_table([*BF16_ROWS, *[("torch.scaled_mm", ROW, p, 0.5, 0.1) for p in PASSES]])
    plan = make_plan(sites, _errors(4, 0.05, 0.01), bench)
    stakes = plan.summary.undecided_stakes
    assert stakes["candidates"] == 3 and stakes["passes"] == ["fc/dgrad", "fc/fwd", "fc/wgrad"]
    bold = make_plan(sites, _errors(4, 0.05, 0.01), bench, PlanConfig(allow_undecided=True))
    assert stakes["gemm_speedup"] == bold.summary.gemm_speedup > plan.summary.gemm_speedup
    assert stakes["batches"] == 5
    line = next(x for x in plan.summary.lines() if x.startswith("of those, 3 would change"))
    assert "about 5 sampled batches in all" in line
    # The stakes survive the round trip a saved or broadcast plan takes.
    assert PlanSummary.from_dict(dict(plan.summary.__dict__)).undecided_stakes == stakes
    # FP8 slower than bf16 at every pass: deciding would change nothing.
    slow = bench_table([*BF16_ROWS, *[("torch.scaled_mm", ROW, p, 5.0, 0.1) for p in PASSES]])
    idle = make_plan(sites, _errors(4, 0.05, 0.01), slow)
    assert idle.summary.undecided is not None and idle.summary.undecided_stakes is None


def test_a_pass_refused_for_its_varying_error_says_so() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    errors = errors_table(
        [("fc", ROW, "fwd", 0.7, "unsafe"), ("fc", TENSOR, "fwd", 0.08, "unsafe")]
    )
    # Probe's extra columns: the row recipe errs 0.02 overall and 2.8 on what varies.
    extra = pl.DataFrame({"balanced_rel_err": [0.02, 0.07], "varying_rel_err": [2.8, 0.1]})
    errors = pl.concat([errors, extra], how="horizontal")
    bench = bench_table(
        [*BF16_ROWS, ("torch.scaled_mm", ROW, "fwd", 0.5, 0.1), ("torch.scaled_mm", TENSOR, "fwd", 0.4, 0.1)]
    )  # fmt: skip
    fwd = plan_rows(make_plan(sites, errors, bench))["fwd"]
    assert fwd["recipe"] == "bf16"
    reasons = {(r["backend"], r["recipe"]): r["reason"] for r in fwd["rejected"]}
    row = reasons[("torch.scaled_mm", ROW)]
    assert row.startswith("unsafe: error bound 0.7 > budget 0.06 from its varying error")
    assert "adds 2.8 to the part of the output that varies" in row
    # Over budget by its balanced error: no varying note.
    assert "varying" not in reasons[("torch.scaled_mm", TENSOR)]


def test_a_dgrad_refused_for_its_summed_error_says_so() -> None:
    sites = sites_table(("fc", 1024, 4096, 8192, None))
    errors = errors_table([("fc", ROW, "dgrad", 0.4, "unsafe"), ("fc", ROW, "fwd", 0.1, "unsafe")])
    # Probe's extra columns: the dgrad errs 0.03 overall and 0.4 on its sum over the batch;
    # the fwd is over budget by its balanced error.
    extra = pl.DataFrame({
        "balanced_rel_err": [0.03, 0.1], "varying_rel_err": [0.03, 0.1],
        "summed_rel_err": [0.4, 0.1], "error_part": ["summed", "balanced"],
    })  # fmt: skip
    errors = pl.concat([errors, extra], how="horizontal")
    bench = bench_table(
        [*BF16_ROWS, *[("torch.scaled_mm", ROW, p, 0.5, 0.1) for p in ("fwd", "dgrad")]]
    )
    rows = plan_rows(make_plan(sites, errors, bench))
    (dgrad,) = rows["dgrad"]["rejected"]
    assert (
        "from its summed error: FP8 adds 0.4 to the output's sum over the batch"
        in (dgrad["reason"])
    )
    (fwd,) = rows["fwd"]["rejected"]
    assert "from its" not in fwd["reason"]
