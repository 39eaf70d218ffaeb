"""A site's three passes are chosen together, because FP8 passes share quantizations: the
forward's `quantize(x)` also yields the wgrad's x^T when both quantize x alike (a
transpose-quantization instead), and the dgrad's dY serves the wgrad's dY^T. Each
`kernel_bench` row costs its pass standalone; a combination is credited the shared
quantization time, booked to the wgrad. A combination is valid only if every FP8 pass,
credits included, is faster than bf16 by `PlanConfig.margin(pass_)`; bf16 everywhere is always valid.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from loka.dispatch.planner.candidates import Option, SiteChoice
from loka.dispatch.planner.config import PlanConfig
from loka.schema import PASSES, Recipe


class PassTimes(NamedTuple):
    """Per-pass times (ms) of a combination, shared quantizations credited."""

    fwd: float
    dgrad: float
    wgrad: float


class Combo(NamedTuple):
    """One candidate per pass of a site, with what it costs and risks."""

    total: float  # ms, the three passes
    error: float  # the sum of its FP8 passes' error bounds
    options: tuple[Option, Option, Option]  # fwd, dgrad, wgrad
    times: PassTimes

    @property
    def fp8_passes(self) -> int:
        return sum(not o.is_bf16 for o in self.options)


def _operand_quant(recipe: Recipe, fmt: str) -> tuple:
    return (fmt, recipe.granularity, recipe.scaling, recipe.history, recipe.pow2, recipe.scale_ub)


def effective_times(options: tuple[Option, Option, Option], share: bool) -> PassTimes:
    """Per-pass times of a (fwd, dgrad, wgrad) combination, shared quantizations credited to
    the wgrad (never more than the wgrad's own quantization time)."""
    fwd, dgrad, wgrad = options
    wgrad_ms = wgrad.median_ms
    if share and not wgrad.is_bf16:
        credit = 0.0
        w = wgrad.recipe
        # A fused norm quantizes x rowwise per token only: no x^T to share.
        if (
            not fwd.is_bf16
            and not fwd.fused
            and _operand_quant(fwd.recipe, fwd.recipe.a_format) == _operand_quant(w, w.b_format)
        ):
            credit += fwd.quant_ms
        if not dgrad.is_bf16 and _operand_quant(
            dgrad.recipe, dgrad.recipe.a_format
        ) == _operand_quant(w, w.a_format):
            credit += dgrad.quant_ms
        wgrad_ms -= min(credit, wgrad.quant_ms)
    return PassTimes(fwd.median_ms, dgrad.median_ms, wgrad_ms)


def combine(choice: SiteChoice, config: PlanConfig) -> list[Combo]:
    """The valid combinations of a site's candidates: those with every forced pass
    (`PlanConfig.force`) in FP8 first, then fastest first; among equal times the one with
    fewer FP8 passes, then less error. A forced pass needs no margin over bf16."""
    bf16 = tuple(choice.bf16[p] for p in PASSES)
    pools = [[choice.bf16[p], *choice.options[p]] for p in PASSES]
    forced = [config.forced(choice.site, p) for p in PASSES]
    # A traceable backend quantizes each operand in its own fused kernel: nothing is shared.
    share = config.share_quantization and config.mode == "eager"
    combos = []
    for options in itertools.product(*pools):
        times = effective_times(options, share)
        if any(
            not o.is_bf16 and not f and t * config.margin(p) >= b.median_ms
            for o, t, b, p, f in zip(options, times, bf16, PASSES, forced, strict=True)
        ):
            continue
        error = sum(o.err for o in options if not o.is_bf16)
        combos.append(Combo(sum(times), error, options, times))

    def unforced(c: Combo) -> int:  # forced passes left in bf16 though an FP8 one was safe
        return sum(f and o.is_bf16 and bool(choice.options[p])
                   for o, f, p in zip(c.options, forced, PASSES, strict=True))  # fmt: skip

    combos.sort(key=lambda c: (unforced(c), round(c.total, 9), c.fp8_passes, c.error))
    return combos
