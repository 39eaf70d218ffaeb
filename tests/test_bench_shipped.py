"""bench/shipped.py builds loka-dispatch's shipped H200 `kernel_bench` table from the
recorded runs in bench/shipped_sources/; the table the package ships is what it builds."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import polars as pl

from loka.dispatch.bench.cost_model import CostModel

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

shipped = harness.load("shipped")  # importing it runs nothing
build_shipped_table = shipped.build_shipped_table


def test_shipped_table_is_what_the_script_builds() -> None:
    model = CostModel.shipped()
    built = build_shipped_table()
    assert model.table.height == built.height > 1500
    assert model.table.drop("source").equals(built.drop("source")) or (
        (model.table["median_ms"] - built["median_ms"]).abs().max() < 1e-12
    )
    assert model.device.device == "NVIDIA H200"
    measured = model.table.filter(~pl.col("estimated"))
    # The dispatch_table run measured every backend and pass at the zoo's shapes; the
    # derived rows never shadow a measured one.
    assert {"torch.scaled_mm", "triton.fp8", "torch.bf16"} <= set(measured["backend"])
    assert set(measured["pass"]) == {"fwd", "dgrad", "wgrad"} and measured.height > 700
    key = ["backend", "recipe", "pass", "M_bucket", "K", "N", "groups"]
    assert model.table.select(key).is_unique().all()
    assert model.table["driver"].n_unique() == 1


def test_the_script_writes_the_package_data_by_default() -> None:
    package_data = (
        Path(str(resources.files("loka.dispatch"))) / "data" / "h200_kernel_bench.parquet"
    )
    assert shipped.SHIPPED.resolve() == package_data.resolve() and package_data.is_file()
    assert {p.name for p in shipped.SOURCES.iterdir()} >= {
        shipped.ANCHORS,
        shipped.KERNELS,
        shipped.MEASURED,
    }
