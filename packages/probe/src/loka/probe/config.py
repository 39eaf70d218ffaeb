"""`ProbeConfig`: what Probe samples, which recipes it tries, and how it decides."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from loka.schema import PASSES, Recipe

DEFAULT_RECIPES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "fwd": (
            "e4m3:e4m3/tensor/dynamic",
            "e4m3:e4m3/row/dynamic",
            "e4m3:e4m3/block/dynamic",
            "e4m3:e4m3/tensor/dynamic/pow2",
            "e4m3:e4m3/row/dynamic/pow2",
            "e4m3:e4m3/block/dynamic/pow2",
            "e4m3:e4m3/tensor/delayed16",
            # where the inputs collapse towards one vector (README: "The part of the output
            # that tells examples apart"), only a centered forward keeps what varies
            "e4m3:e4m3/row/dynamic/center",
        ),
        # The gradient is the first operand of both backward passes.
        "dgrad": (
            "e5m2:e4m3/tensor/dynamic",
            "e4m3:e4m3/tensor/dynamic",
            "e4m3:e4m3/row/dynamic",
        ),
        "wgrad": (
            "e5m2:e4m3/tensor/dynamic",
            "e4m3:e4m3/tensor/dynamic",
            "e4m3:e4m3/row/dynamic",
        ),
    }
)
"""Candidate recipes per pass (README: "Default recipes")."""

SMALL_SITE_SIZE = 256 * 256
"""K * N up to which a site's error analysis runs on the CPU by default."""
DENSE_HOST_ERROR_MAX_SIZE = 0
"""`host_error_max_size` for a dense probing phase (see `ProbeConfig`)."""

DEFAULT_BUDGETS: Mapping[str, float] = MappingProxyType({"fwd": 0.06, "dgrad": 0.09, "wgrad": 0.09})
"""Largest acceptable balanced relative error per pass (README: "Default budgets")."""


@dataclass(frozen=True)
class ProbeConfig:
    """Everything Probe can be told. The defaults are for monitoring a whole training run:
    they keep the step-time overhead near 3% on the zoo's DHEN large on an H200
    (bench/probe_overhead.py; the README has the numbers) and decide a site's verdicts
    after about `min_batches * sites / max_sites_per_step` sampled steps. A short, dense
    probing phase (what loka.dispatch's Session runs before planning) sets `every=1`,
    `warmup_steps=0` and no site cap."""

    # Schedule: steps 0, warmup_every, 2*warmup_every, ... below warmup_steps, then every
    # `every` steps. A site whose verdicts are all decided is captured on one sampled step
    # in `decided_every` (re-verification), so sampling concentrates on undecided sites.
    # The cost of a sampled step is mostly the background thread's Python work per site,
    # which competes with the training loop for the GIL: `max_sites_per_step` bounds it.
    every: int = 50
    warmup_steps: int = 200
    warmup_every: int = 20
    decided_every: int = 4
    max_sites_per_step: int | None = 16
    # Rows sampled per GEMM call (activations and gradients; same rows for x and dY) and
    # per weight (for its statistics).
    rows: int = 256
    recipes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_RECIPES))
    budgets: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BUDGETS))
    # Per-site overrides: {glob pattern on the site name: {pass: budget}}; the last
    # matching pattern wins.
    site_budgets: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    confidence: float = 0.95
    min_batches: int = 5
    # How much more than the budget FP8 may err on the output's token-to-token part (the
    # varying error, README "The part of the output that tells examples apart"): a batch's
    # error is max(balanced, varying excess / varying_allowance).
    varying_allowance: float = 4.0
    # The same for the error of a dgrad output's sum over the batch (the summed error,
    # README "The gradient's sum over the batch"): max(..., summed excess / summed_allowance).
    summed_allowance: float = 1.0
    # A site whose |x| tail (p99.9, amax) or mean error moves by more than this factor
    # between two windows is flagged and re-verified from the newer window on.
    drift_tolerance: float = 2.0
    window_steps: int = 200
    # Sampled steps whose statistics may wait for the background thread. A step that
    # finds the queue full waits up to `queue_wait_s` for a slot (the training loop pauses:
    # on a dense schedule such as every=1 the thread cannot keep up otherwise, and dropped
    # steps leave verdicts undecided), then is dropped and counted. None: wait as needed.
    queue_size: int = 2
    queue_wait_s: float | None = 30.0
    timing: bool = True
    # Sites with K * N at most this compute their error GEMMs on the CPU, where hundreds
    # of tiny kernels cost the GPU nothing. A dense probing phase, which samples every
    # site on every sampled step, is better off with 0 (`DENSE_HOST_ERROR_MAX_SIZE`): its
    # sites' graphs replay from their third sampled step, and a replay costs the host
    # almost nothing where the CPU's arithmetic on a small site costs ~10 ms (DHEN large
    # on an H100's host: 1.64 -> 0.40 s per sampled step). Monitoring samples a site too
    # rarely for that: there the small sites' eager GPU work cost the step more
    # (`bench/results/probe_overhead_h100_20261205-14*`).
    host_error_max_size: int = SMALL_SITE_SIZE
    real_fp8: bool = True
    # On a GPU, a site's error analysis is captured as a CUDA graph the second time its
    # layout comes and replayed after (`loka.probe.error_graphs`): the analysis is bound by
    # host time per op. Costs a copy of the analysed sites' sampled rows and weights.
    error_graphs: bool = True
    exclude: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        # A lone string is one pattern: iterating it would match single characters.
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        bad = [p for p in self.exclude if not isinstance(p, str) or not p]
        if bad:
            raise TypeError(f"ProbeConfig.exclude holds site patterns (strings), got {bad!r}")
        for name in ("every", "warmup_every", "decided_every", "rows", "min_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ProbeConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "host_error_max_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ProbeConfig.{name} must be a non-negative integer, got {value!r}"
                )
        if self.window_steps < 1 or self.queue_size < 1:
            raise ValueError("ProbeConfig.window_steps and queue_size must be at least 1")
        if self.queue_wait_s is not None and not self.queue_wait_s >= 0:
            raise ValueError(
                f"ProbeConfig.queue_wait_s must be >= 0 seconds or None, got {self.queue_wait_s}"
            )
        if self.max_sites_per_step is not None and self.max_sites_per_step < 1:
            raise ValueError("ProbeConfig.max_sites_per_step must be >= 1 or None")
        for name in ("varying_allowance", "summed_allowance"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 1):
                raise ValueError(
                    f"ProbeConfig.{name} is a factor >= 1 (1: that error counts like the "
                    f"balanced one), got {value!r}"
                )
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"ProbeConfig.confidence must be in [0.5, 1), got {self.confidence}")
        if not self.drift_tolerance > 1:
            raise ValueError(
                f"ProbeConfig.drift_tolerance is a factor > 1, got {self.drift_tolerance}"
            )
        unknown = set(self.recipes) - set(PASSES)
        if unknown:
            raise ValueError(
                f"ProbeConfig.recipes has unknown passes {sorted(unknown)}; use {PASSES}"
            )
        for pass_, texts in self.recipes.items():
            if isinstance(texts, str):
                raise TypeError(
                    f"ProbeConfig.recipes[{pass_!r}] must be a sequence of recipe strings"
                )
            for text in texts:
                if Recipe.parse(text).is_bf16:
                    raise ValueError(
                        f"ProbeConfig.recipes[{pass_!r}]: bf16 is the reference, not a candidate"
                    )
                if Recipe.parse(text).center and pass_ == "wgrad":
                    raise ValueError(
                        f"ProbeConfig.recipes['wgrad']: {text!r} centers its first operand over "
                        "the tokens, and wgrad reduces over the tokens (center is for fwd and "
                        "dgrad)"
                    )
        for budgets in (self.budgets, *self.site_budgets.values()):
            for pass_, value in budgets.items():
                if pass_ not in PASSES:
                    raise ValueError(f"budget for unknown pass {pass_!r}; use {PASSES}")
                if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                    raise ValueError(
                        f"budget for {pass_!r} must be a positive number, got {value!r}"
                    )
        missing = [p for p in self.recipes if self.recipes[p] and p not in self.budgets]
        if missing:
            raise ValueError(f"ProbeConfig.budgets has no budget for pass(es) {missing}")

    def parsed_recipes(self) -> dict[str, list[Recipe]]:
        return {p: [Recipe.parse(t) for t in self.recipes.get(p, ())] for p in PASSES}

    def budget(self, site: str, pass_: str) -> float:
        value = self.budgets[pass_]
        for pattern, budgets in self.site_budgets.items():
            if pass_ in budgets and fnmatch.fnmatchcase(site, pattern):
                value = budgets[pass_]
        return float(value)

    def excluded(self, site: str) -> bool:
        return any(fnmatch.fnmatchcase(site, pattern) for pattern in self.exclude)

    def is_sampled(self, step: int) -> bool:
        if step < self.warmup_steps:
            return step % self.warmup_every == 0
        return (step - self.warmup_steps) % self.every == 0

    def history_lengths(self) -> set[int]:
        return {
            r.history for recipes in self.parsed_recipes().values() for r in recipes if r.history
        }
