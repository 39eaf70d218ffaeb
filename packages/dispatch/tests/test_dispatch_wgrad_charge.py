"""The compiled wgrad charge (`PlanConfig.wgrad_quant_factor`) against what was measured.

The H200 timings of the xl plans, bf16 baselines re-timed (`bench/results/kernel_bench_xl_
h200_20261203T1612Z.parquet`), at the three shapes whose FP8 wgrad passes were A/B'd in the
whole compiled step, one process each (bench/results/README.md):

- DHEN xl `blocks.*.fc1` (16384 x 2048 -> 4096, rowwise, timed 1.14x): lost ~0.65 ms a
  pass in place (`realized_20261203T115719Z`);
- Wukong xl `layers.*.fmb.mlp.3` (16384 x 4096 -> 4096, rowwise, timed 1.31x): gained
  nothing (`realized_20261203T140204Z`: 1.110x with them, 1.119x without);
- HSTU xl `layers.*.uvqk` (32768 x 3072 -> 12288, tensor scales, timed 1.35x against its
  re-timed baseline): gained 1.4% of the step (`realized_20261203T141237Z`: 1.097x with
  them, 1.082x without; `..161213Z`, planned at a 2.0 charge without them: 1.080x).

A compiled plan must keep only HSTU's; planned on the standalone timing (`wgrad_quant_factor=1`)
it keeps all three, which is what lost.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the planner tests' table builders
from test_dispatch_planner import errors_table, sites_table

from loka.dispatch.planner import PlanConfig, make_plan

TIMINGS = Path(__file__).parents[3] / "bench/results/kernel_bench_xl_h200_20261203T1612Z.parquet"
# site, K, N, M, the recipe its plan took, what the A/B said
MEASURED = (
    ("dhen.fc1", 2048, 4096, 16384, "e4m3:e4m3/row/dynamic", False),
    ("wukong.fmb.mlp.3", 4096, 4096, 16384, "e4m3:e4m3/row/dynamic", False),
    ("hstu.uvqk", 3072, 12288, 32768, "e5m2:e4m3/tensor/dynamic", True),
)


def _plan(config: PlanConfig) -> dict[str, str]:
    """Each measured site's wgrad recipe as planned from the recorded timings (its other
    passes unsafe, so the wgrad decides alone)."""
    if not TIMINGS.exists():
        pytest.skip(f"{TIMINGS.name} absent (the recorded H200 timings)")
    bench = pl.read_parquet(TIMINGS)
    sites = sites_table(*[(s, k, n, m, None) for s, k, n, m, _, _ in MEASURED])
    rows = []
    for site, *_, recipe, _ in MEASURED:
        rows += [(site, recipe, "wgrad", 0.01, "safe"), (site, recipe, "fwd", 0.5, "unsafe"),
                 (site, recipe, "dgrad", 0.5, "unsafe")]  # fmt: skip
    plan = make_plan(sites, errors_table(rows), bench, config)
    return {
        r["site"]: r["recipe"] for r in plan.table.iter_rows(named=True) if r["pass"] == "wgrad"
    }


@pytest.mark.parametrize("mode", ["compiled", "cudagraphs"])
def test_the_charge_keeps_the_wgrad_passes_that_paid_in_place(mode):
    planned = _plan(PlanConfig(mode=mode))
    assert planned == {s: r if paid else "bf16" for s, _, _, _, r, paid in MEASURED}


def test_the_standalone_timing_keeps_the_ones_that_lost():
    planned = _plan(PlanConfig(mode="compiled", wgrad_quant_factor=1.0))
    assert planned == {s: r for s, _, _, _, r, _ in MEASURED}


def test_the_default_sits_inside_the_window_the_measurements_leave():
    # Just below what would drop HSTU's (1.99) and above what keeps Wukong's (1.84).
    assert _plan(PlanConfig(mode="compiled", wgrad_quant_factor=1.85))["hstu.uvqk"] != "bf16"
    assert _plan(PlanConfig(mode="compiled", wgrad_quant_factor=1.98))["hstu.uvqk"] != "bf16"
    assert _plan(PlanConfig(mode="compiled", wgrad_quant_factor=2.0))["hstu.uvqk"] == "bf16"
    assert _plan(PlanConfig(mode="compiled", wgrad_quant_factor=1.83))["wukong.fmb.mlp.3"] != "bf16"
