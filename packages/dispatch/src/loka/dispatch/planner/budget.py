"""The global error budget: the sensitivity-weighted sum of the chosen passes' error bounds
over all sites must stay within `PlanConfig.error_budget_total`; while it does not, the site
change that removes the most weighted error per millisecond lost is made."""

from __future__ import annotations

from typing import NamedTuple

from loka.dispatch.planner.candidates import SiteChoice
from loka.dispatch.planner.config import PlanConfig


class _Move(NamedTuple):
    gain: float  # weighted error removed per ms lost
    choice: SiteChoice
    combo: int  # the index in choice.combos to move to


def spend_error_budget(choices: list[SiteChoice], config: PlanConfig) -> list[str]:
    """Move sites to slower, lower-error combinations until the budget holds (or nothing is
    left to move); the notes say what was done."""
    total = config.error_budget_total
    if total is None:
        return []
    weights = {c.site: config.weight(c.site) for c in choices}

    def spent() -> float:
        return sum(weights[c.site] * c.current().error for c in choices if c.combos)

    moves = 0
    while spent() > total + 1e-12:
        best = None
        for c in choices:
            if not c.combos:
                continue
            t0, e0 = c.current().total, c.current().error
            for j, combo in enumerate(c.combos):
                if combo.error < e0 - 1e-15:
                    gain = weights[c.site] * (e0 - combo.error) / max(combo.total - t0, 1e-9)
                    if best is None or gain > best.gain:
                        best = _Move(gain, c, j)
        if best is None:
            break
        best.choice.chosen = best.combo
        moves += 1
    return [
        f"global error budget {total:.4g}: {moves} site change(s) made, "
        f"weighted error now {spent():.4g}"
    ]
