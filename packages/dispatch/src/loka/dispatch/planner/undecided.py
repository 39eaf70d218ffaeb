"""What the undecided verdicts hold back: the plan as it would be if the undecided FP8
candidates it would take were safe, and about how many more sampled batches would decide
them. A short warm-up leaves many verdicts undecided (DHEN xl after 10 sampled batches:
142 candidates, every MLP forward among them); most of them do not matter to the plan
(a faster candidate is already safe, or bf16 wins anyway), and probing on for all of them
would be waste. The ones that would change the plan are what a longer probe should decide
(`loka.dispatch.Session`'s `decide_steps`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from loka.dispatch.planner.summary import batches_to_decide


@dataclass(frozen=True)
class UndecidedStakes:
    """The undecided candidates an optimistic plan (undecided taken as safe) picks where the
    plan does not: their `site_errors` rows, what that plan predicts, and about how many
    sampled batches (in all, not more; `seen` in the dict: the fewest any of them had) would
    decide most of them."""

    rows: list[dict]
    predicted_speedup: float | None
    gemm_speedup: float
    batches: int | None

    def as_dict(self) -> dict:
        return {
            "candidates": len(self.rows),
            "passes": sorted({f"{r['site']}/{r['pass']}" for r in self.rows}),
            "predicted_speedup": self.predicted_speedup,
            "gemm_speedup": self.gemm_speedup,
            "batches": self.batches,
            "seen": min(int(r["n"]) for r in self.rows),
        }


def undecided_stakes(
    plan_table: pl.DataFrame,
    undecided: list[dict],
    optimistic: Callable[[], tuple[pl.DataFrame, float | None, float]],
) -> UndecidedStakes | None:
    """The stakes of the `undecided` candidates (`site_errors` rows refused as undecided,
    with the budget the plan held them to) behind `plan_table`. `optimistic()` makes the
    plan with undecided candidates allowed and returns (its table, predicted speedup, GEMM
    speedup). None when that plan takes no undecided candidate the plan lacks."""
    if not undecided:
        return None
    table, predicted, gemm = optimistic()
    chosen = {(r["site"], r["pass"]): r["recipe"] for r in plan_table.iter_rows(named=True)}
    taken = {
        (r["site"], r["pass"], r["recipe"])
        for r in table.iter_rows(named=True)
        if r["recipe"] != "bf16" and chosen.get((r["site"], r["pass"])) != r["recipe"]
    }
    rows = [r for r in undecided if (r["site"], r["pass"], r["recipe"]) in taken]
    if not rows:
        return None
    needs = sorted(x for r in rows if (x := batches_to_decide(r)) is not None)
    batches = needs[min(len(needs) - 1, (3 * len(needs)) // 4)] if needs else None
    return UndecidedStakes(rows, predicted, gemm, batches)
