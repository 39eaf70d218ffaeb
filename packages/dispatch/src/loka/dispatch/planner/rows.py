"""The `plan` table's rows: per site and pass the chosen backend and recipe, the predicted
time, speedup and error, and the reason of the choice and of every rejection."""

from __future__ import annotations

import math

import polars as pl

from loka.dispatch.bench.candidates import BF16_BACKEND
from loka.dispatch.planner.candidates import Option, SiteChoice
from loka.dispatch.planner.config import PlanConfig
from loka.schema import PASSES


def plan_rows(choice: SiteChoice, config: PlanConfig) -> list[dict]:
    """The `plan` rows of one site (one per pass): the chosen candidate and why, and why every
    other one lost."""
    rows = []
    base = {"site": choice.site, "K": choice.K, "N": choice.N, "M_p50": choice.M}
    base["norm"] = choice.norm
    if choice.note is not None:
        for pass_ in PASSES:
            b = choice.bf16.get(pass_)
            rows.append(
                {
                    **base, "pass": pass_, "backend": BF16_BACKEND, "recipe": "bf16",
                    "bf16_ms": b.median_ms if b else math.nan,
                    "predicted_ms": b.median_ms if b else math.nan, "predicted_speedup": 1.0,
                    "predicted_rel_err": None, "budget": None,
                    "estimated": bool(b.estimated) if b else False,
                    "reason": f"stays bf16: {choice.note}",
                    "rejected": choice.rejected.get(pass_, []), "fuse_norm": False,
                }
            )  # fmt: skip
        return rows
    best_total = choice.combos[0].total
    current = choice.current()
    total, combo, eff = current.total, current.options, current.times
    budget_moved = not math.isclose(total, best_total)
    for i, pass_ in enumerate(PASSES):
        chosen, t, b = combo[i], eff[i], choice.bf16[pass_]
        rejected = list(choice.rejected[pass_])
        if not chosen.is_bf16:
            why = (
                f"slower: {b.median_ms:.4g} ms vs {t:.4g} ms"
                if b.median_ms > t or not config.forced(choice.site, pass_)
                else f"FP8 forced (PlanConfig.force) though bf16 is faster: {b.median_ms:.4g} "
                f"ms vs {t:.4g} ms"
            )
            rejected.insert(0, {"backend": b.backend, "recipe": "bf16", "reason": why})
        for o in choice.options[pass_]:
            if o is chosen:
                continue
            with_it = _best_with(o, choice, i)
            if math.isinf(with_it):
                what = (
                    "slower than bf16"
                    if o.median_ms >= b.median_ms
                    else f"not {config.margin(pass_):g}x faster than bf16"
                )
                reason = (
                    f"{what}: {o.median_ms:.4g} ms vs {b.median_ms:.4g} ms "
                    "(also with quantizations shared)" + _charge_note(pass_, config)
                )
            elif budget_moved and with_it < total:
                reason = "dropped to meet the global error budget"
            else:
                reason = (
                    f"loses in the site's joint choice of passes: site total with it "
                    f"{with_it:.4g} ms vs {total:.4g} ms chosen"
                )
            rejected.append({"backend": o.label, "recipe": str(o.recipe), "reason": reason})
        if chosen.is_bf16:
            if not choice.options[pass_]:
                reason = "bf16: no FP8 candidate is safe (and allowed) here"
            elif not any(not c.options[i].is_bf16 for c in choice.combos):
                reason = "bf16: no safe FP8 candidate is faster than bf16 here"
            elif budget_moved:
                reason = "bf16: FP8 dropped to meet the global error budget"
            else:
                reason = "bf16: the site is fastest with this pass in bf16"
        else:
            what = (
                "FP8 forced (PlanConfig.force)"
                if config.forced(choice.site, pass_)
                else "fastest safe choice"
            )
            reason = (
                f"{what}: {b.median_ms / max(t, 1e-12):.2f}x bf16, error bound "
                f"{chosen.err:.4g} <= budget {chosen.budget:.4g}"
            )
            if t < chosen.median_ms - 1e-12:
                reason += f" (quantization shared with other passes: {chosen.median_ms - t:.4g} ms)"
            reason += _charge_note(pass_, config)
            if chosen.in_graph is not None:
                operand, op = (
                    ("x", choice.producer) if pass_ == "fwd" else ("dY", choice.grad_producer)
                )
                reason += (
                    f"; {operand}'s quantization costed fused into the {op} computing "
                    f"{operand} ({chosen.in_graph} producer rows: "
                    f"{chosen.in_graph_saved_ms:.3g} ms less than standalone)"
                )
            if chosen.fused:
                reason += (
                    f"; the norm feeding it is fused with the quantization "
                    f"({chosen.quant_ms:+.3g} ms against the bf16 norm)"
                )
            if budget_moved:
                reason += "; a slower, lower-error choice to meet the global error budget"
        rows.append(
            {
                **base, "pass": pass_, "backend": chosen.backend, "recipe": str(chosen.recipe),
                "bf16_ms": b.median_ms, "predicted_ms": t,
                "predicted_speedup": b.median_ms / max(t, 1e-12),
                "predicted_rel_err": None if chosen.is_bf16 else chosen.err,
                "budget": None if chosen.is_bf16 else chosen.budget,
                "estimated": bool(chosen.estimated or b.estimated), "reason": reason,
                "rejected": rejected, "fuse_norm": chosen.fused,
            }
        )  # fmt: skip
    return rows


def _best_with(option: Option, choice: SiteChoice, i: int) -> float:
    """The fastest valid site total with `option` as pass i (inf: none is valid)."""
    totals = [c.total for c in choice.combos if c.options[i] is option]
    return min(totals) if totals else math.inf


PLAN_TYPES = {  # columns whose type the rows alone do not settle (all null, nested)
    "predicted_rel_err": pl.Float64,
    "budget": pl.Float64,
    "rejected": pl.List(
        pl.Struct({"backend": pl.String, "recipe": pl.String, "reason": pl.String})
    ),
    "fuse_norm": pl.Boolean,
    "norm": pl.String,
}


def _charge_note(pass_: str, config: PlanConfig) -> str:
    """What the pass's time includes beyond its standalone timing (`_in_place`)."""
    factor = config.quant_charge(pass_)
    if factor == 1.0:
        return ""
    return f"; its quantization charged at {factor:g}x its standalone time, as the {config.mode} step pays it"
