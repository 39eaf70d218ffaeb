"""The planner: per GEMM site and pass, the fastest candidate whose error is safe.

Inputs are tables only (`sites`, `site_errors`, `kernel_bench`), so a plan can be made from
saved parquet files on a machine without Probe, the model or a GPU.

Per site, at its median M (bucketed as in `kernel_bench`), K and N:
1. `candidates`: the candidates of a pass are the backends timed for each recipe Probe
   measured there (a recipe's timing is looked up by its speed key: formats, granularity,
   scaling kind). A candidate is eligible when its verdict is safe (or undecided, if
   allowed), its accumulation mode is allowed and its backend runs in the plan's mode
   (`PlanConfig.mode`; eager plans are charged the backends' measured host time); every
   other one is rejected with the reason. A site fed by its own norm (`sites.norm`) also
   weighs fusing that norm with the forward's quantization.
2. `sharing`: the site's three passes are chosen together, because FP8 passes share
   quantizations (the forward's x serves the wgrad's x^T, the dgrad's dY the wgrad's dY^T);
   a combination is valid only if every FP8 pass, credits included, is faster than bf16 by
   `min_speedup`; the fastest valid one wins (bf16 everywhere is always valid).
3. `budget`: optionally, a global error budget: the sensitivity-weighted sum of the chosen
   passes' error bounds over all sites must stay within `error_budget_total`; while it does
   not, the site change that removes the most weighted error per millisecond lost is made.
`rows` writes the `plan` table with every choice's and rejection's reason; `summary`
reports the predicted end-to-end speedup against its ceiling (DESIGN.md).
"""

from loka.dispatch.planner.config import MODES, PlanConfig
from loka.dispatch.planner.plan import Plan, make_plan, sites_fingerprint, tables_fingerprint
from loka.dispatch.planner.summary import PlanSummary, batches_to_decide, undecided_note

__all__ = [
    "MODES",
    "Plan",
    "PlanConfig",
    "PlanSummary",
    "batches_to_decide",
    "make_plan",
    "sites_fingerprint",
    "tables_fingerprint",
    "undecided_note",
]
