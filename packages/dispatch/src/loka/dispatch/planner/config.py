"""`PlanConfig`: how the planner decides."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from loka.schema import PASSES

# How the model will run: eager, torch.compile, or torch.compile(mode="reduce-overhead").
MODES = ("eager", "compiled", "cudagraphs")
# The speedup over bf16 each FP8 pass must show, per mode and pass, unless `min_speedup` is
# given: 5%, above the run-to-run noise of kernel medians and the cost model's typical error.
MIN_SPEEDUP = {mode: dict.fromkeys(PASSES, 1.05) for mode in MODES}
# What a wgrad pass's quantizations cost inside the step, as a multiple of their standalone
# time (`wgrad_quant_factor`). A wgrad quantizes x and dY transposed, scaled per column (an
# amax over all the batch's tokens, then a transposing cast). Timed alone, compiled, that is
# one kernel pair per operand; inside a compiled step inductor fuses it with the backward's
# other reductions and recomputes the producer in the transposed cast, and it cost 2.7-3.0x
# its standalone time in DHEN xl's MLP block (the block's profiles,
# bench/results/wgrad_in_graph_20261203T140008Z and ..142518Z: +0.78 ms of quantizing
# kernels for two passes timed 0.29 ms). Whole models, one process each, with and without
# their wgrad passes: Wukong xl's seven (4096 x 4096, timed 1.31x) gained nothing (..140204Z),
# HSTU xl's three (the uvqk projection, tensor scales, timed 1.56x) gained 1.4% of the step
# (..141237Z).
# With the bf16 baselines as re-timed on 12-03 (`benchmark(retime_baselines=True)`;
# bench/results/kernel_bench_xl_h200_20261203T1612Z.parquet: HSTU's uvqk wgrad 3.20 ms,
# not the 3.70 ms the cache had kept), a 1.05 margin drops a pass at these charges and above:
# DHEN's `fc1` 1.22x, InterFormer's `interaction.fc2` 1.58x, Wukong's 4096 x 4096 1.84x,
# HSTU's uvqk 1.99x. 1.9 drops the three that did not pay and keeps HSTU's, which did; the
# window is narrow, and DHEN's and Wukong's baselines, not yet re-timed, can only lower
# theirs. Eager plans use backends that quantize x and dY once for two passes, timed as
# run: no charge. This replaced a compiled wgrad margin of 1.15, which Wukong's passes
# cleared, and then a charge of 2.0, which dropped HSTU's once its baseline was re-timed
# (realized_20261203T161213Z: 1.080x without them).
WGRAD_QUANT_FACTOR = {"eager": 1.0, "compiled": 1.9, "cudagraphs": 1.9}


@dataclass(frozen=True)
class PlanConfig:
    """How the planner decides."""

    # Demand this speedup over bf16 from every FP8 pass, so that a pass is not switched to
    # FP8 for a gain nobody could measure. None: the mode's defaults per pass
    # (`MIN_SPEEDUP`: 1.05); `margin(pass_)` is the value in force.
    min_speedup: float | None = None
    # A wgrad pass's quantization time is charged at this multiple of its standalone time
    # (None: the mode's, `WGRAD_QUANT_FACTOR`: 1.9 compiled, 1.0 eager); `wgrad_quant_charge`
    # is the value in force.
    wgrad_quant_factor: float | None = None
    # Fast-accumulation backends (".fast") accumulate a whole K in reduced precision; Probe's
    # errors do not cover that, so they are candidates only when allowed.
    allow_fast_accum: bool = False
    # Undecided verdicts (too few batches to be sure) are rejected unless allowed.
    allow_undecided: bool = False
    # Override the budget Probe judged against, per pass (None: use the table's).
    budgets: Mapping[str, float] | None = None
    # Sensitivity-weighted sum of error bounds over all FP8 passes that the plan may spend.
    error_budget_total: float | None = None
    # Weight of each site's error in that sum (glob pattern -> weight; default 1).
    sensitivity: Mapping[str, float] = field(default_factory=dict)
    # Patterns never planned for FP8: a site name glob ("head.*"), or a site glob and a
    # pass ("layers.*.mlp.1/wgrad": that pass only; the others stay candidates).
    exclude: tuple[str, ...] = ()
    # Patterns (as `exclude`'s) planned for FP8 wherever a safe candidate exists, faster than
    # bf16 or not: for an A/B on the real step where the standalone bench may misjudge the
    # cost (a quantization inductor fuses into the op that makes the input); verification
    # still holds the real step to not slower than bf16. `exclude` wins where both match.
    force: tuple[str, ...] = ()
    # Credit quantizations shared between passes (see `loka.dispatch.planner.sharing`).
    share_quantization: bool = True
    # Compiled plans: cost a forward's quantization of x (a dgrad's of dY) as inductor runs
    # it, fused into the op that computes it where that is elementwise or a norm
    # (`sites.producer`, `sites.grad_producer`; timed by the bench's producer rows); False
    # costs it standalone, a read of the operand more than it runs.
    fuse_into_producer: bool = True
    # Plan for inference: only the forward pass counts (dgrad and wgrad stay bf16).
    inference: bool = False
    # FP8 candidates whose time is an estimate (the cost model's), not a measurement. None:
    # allowed only when the whole table is estimated (planning for a GPU that is absent);
    # on a table measured on the GPU, a shape left unmeasured (bench budget spent) stays
    # bf16, because estimates at skinny shapes can be far off (see the README).
    allow_estimated: bool | None = None
    # How the planned model runs ("eager", "compiled", "cudagraphs"). Compiled plans take
    # only traceable backends (`Backend.traceable`: quantization in torch ops, fused by
    # inductor, no Python per call, capturable as a CUDA graph); eager plans take the others,
    # since a traceable backend's quantization runs unfused (and is timed fused) in eager.
    mode: str = "eager"
    # Eager plans add each FP8 pass's measured extra host time (`host_ms`) to its time, as a
    # step bound by the host pays it. A step bound by the device hides that host work behind
    # the GPU's queue: False plans on device time alone (and verification on the real step
    # says whether the step was in fact device-bound).
    charge_host: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.min_speedup is not None and not (
            math.isfinite(self.min_speedup) and self.min_speedup >= 1.0
        ):
            raise ValueError(f"min_speedup must be >= 1, got {self.min_speedup}")
        if self.wgrad_quant_factor is not None and not (
            math.isfinite(self.wgrad_quant_factor) and self.wgrad_quant_factor >= 1.0
        ):
            raise ValueError(f"wgrad_quant_factor must be >= 1, got {self.wgrad_quant_factor}")
        if self.error_budget_total is not None and not self.error_budget_total >= 0:
            raise ValueError(f"error_budget_total must be >= 0, got {self.error_budget_total}")
        for pass_, value in (self.budgets or {}).items():
            if pass_ not in PASSES or not value > 0:
                raise ValueError(f"budgets: bad entry {pass_!r}: {value!r}")
        for name in ("exclude", "force"):
            for pattern in getattr(self, name):
                _, slash, pass_pattern = pattern.partition("/")
                if slash and not any(fnmatch.fnmatchcase(p, pass_pattern) for p in PASSES):
                    raise ValueError(
                        f"{name}: {pattern!r} names no pass ({', '.join(PASSES)}) after the '/'"
                    )
        for pattern, weight in self.sensitivity.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"sensitivity[{pattern!r}] must be >= 0, got {weight}")

    def margin(self, pass_: str) -> float:
        """The speedup over bf16 an FP8 `pass_` must show: `min_speedup`, else the mode's."""
        return MIN_SPEEDUP[self.mode][pass_] if self.min_speedup is None else self.min_speedup

    def wgrad_quant_charge(self) -> float:
        """The multiple of its standalone time a wgrad pass's quantization is charged:
        `wgrad_quant_factor`, else the mode's."""
        if self.wgrad_quant_factor is not None:
            return self.wgrad_quant_factor
        return WGRAD_QUANT_FACTOR[self.mode]

    def quant_charge(self, pass_: str) -> float:
        """The multiple of its standalone time `pass_`'s quantization is charged: the wgrad
        charge for a wgrad pass, 1 for the others."""
        return self.wgrad_quant_charge() if pass_ == "wgrad" else 1.0

    def weight(self, site: str) -> float:
        value = 1.0
        for pattern, weight in self.sensitivity.items():
            if fnmatch.fnmatchcase(site, pattern):
                value = weight
        return value

    def excluded(self, site: str, pass_: str | None = None) -> bool:
        """Whether `site` (with `pass_`: that pass of it) is excluded from FP8."""
        return _matches(self.exclude, site, pass_)

    def forced(self, site: str, pass_: str) -> bool:
        """Whether `pass_` of `site` is forced to FP8 where safe (`force`, not excluded)."""
        return _matches(self.force, site, pass_) and not self.excluded(site, pass_)


def _matches(patterns: tuple[str, ...], site: str, pass_: str | None) -> bool:
    """Whether a `site` glob (alone, or with a `/pass` glob matching `pass_`) matches."""
    for pattern in patterns:
        site_pattern, _, pass_pattern = pattern.partition("/")
        if not fnmatch.fnmatchcase(site, site_pattern):
            continue
        if not pass_pattern or (pass_ is not None and fnmatch.fnmatchcase(pass_, pass_pattern)):
            return True
    return False
