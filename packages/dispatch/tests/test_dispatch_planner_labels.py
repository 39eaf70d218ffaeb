"""The planner checks error bounds against budgets itself (issue 16 item 4): a site_errors
row labelled "safe" whose bound exceeds the budget is unsafe, and a bound that is not a
number is refused with its own reason; never a pass in FP8 on a label alone."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import sys

import polars as pl
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the planner tests' table builders
from test_dispatch_planner import BF16_ROWS, ROW, bench_table, errors_table, plan_rows, sites_table

from loka.dispatch.planner import PlanConfig, make_plan
from loka.schema import PASSES

SITES = sites_table(("fc", 1024, 4096, 8192, 0.5))
BENCH = bench_table(BF16_ROWS + [("triton.fp8", ROW, p, 0.5, 0.05) for p in PASSES])


def _plan(ucb: float, verdict: str = "safe"):
    errors = errors_table([("fc", ROW, p, ucb, verdict) for p in PASSES])
    return plan_rows(make_plan(SITES, errors, BENCH))


def _reason(row: dict) -> str:
    return next(r["reason"] for r in row["rejected"] if r["recipe"] == ROW)


def test_a_bound_within_the_budget_still_plans_fp8() -> None:
    rows = _plan(0.05)
    assert {rows[p]["recipe"] for p in PASSES} == {ROW}


def test_a_safe_label_over_the_budget_is_unsafe() -> None:
    rows = _plan(0.9)  # "safe", 10x the backward budget (0.09) and 15x the forward one
    assert {rows[p]["recipe"] for p in PASSES} == {"bf16"}
    assert _reason(rows["fwd"]).startswith("unsafe: error bound 0.9 > budget 0.06")
    assert "labelled safe" in _reason(rows["dgrad"])
    # An undecided label over the budget by its lower bound too is no better.
    errors = errors_table([("fc", ROW, p, 0.9, "undecided") for p in PASSES])
    rows = plan_rows(make_plan(SITES, errors, BENCH, PlanConfig(allow_undecided=True)))
    assert {rows[p]["recipe"] for p in PASSES} == {"bf16"}
    assert "labelled undecided" in _reason(rows["wgrad"])


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), -float("inf"), -0.5])
def test_a_bound_that_is_not_a_number_is_refused(bound: float) -> None:
    # The schema leaves the confidence bounds free; the mean stays a plausible 0.045.
    errors = errors_table([("fc", ROW, p, 0.05, "safe") for p in PASSES]).with_columns(
        pl.lit(bound).alias("ucb_rel_err")
    )
    for config in (PlanConfig(), PlanConfig(budgets={"fwd": 0.5})):
        rows = plan_rows(make_plan(SITES, errors, BENCH, config))
        assert {rows[p]["recipe"] for p in PASSES} == {"bf16"}
        reason = _reason(rows["fwd"])
        assert f"error bound {bound} is not a finite number >= 0: refused" == reason


def test_a_missing_upper_bound_falls_back_to_the_checked_mean() -> None:
    errors = errors_table([("fc", ROW, p, 0.9, "safe") for p in PASSES]).with_columns(
        pl.lit(None, dtype=pl.Float64).alias("ucb_rel_err")
    )  # mean_rel_err is 0.81: over every budget
    rows = plan_rows(make_plan(SITES, errors, BENCH))
    assert {rows[p]["recipe"] for p in PASSES} == {"bf16"}
    assert "0.81 > budget" in _reason(rows["fwd"])
