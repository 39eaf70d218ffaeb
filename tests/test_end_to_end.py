"""Across packages: Probe on a zoo model -> tables on disk -> plan and report without
loka-probe or loka-zoo installed -> apply through loka.mods -> training goes on."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
import textwrap

import polars as pl
import torch

import loka.zoo as zoo
from loka.dispatch import PlanConfig, apply, load_probe_tables, make_plan
from loka.dispatch.testing import synthetic_kernel_bench
from loka.mods.fp8_linear import Fp8Linear
from loka.probe import Probe, ProbeConfig

PLAN_WITHOUT_PROBE = textwrap.dedent(
    """
    import sys
    sys.modules["loka.probe"] = None  # neither installed: importing them fails
    sys.modules["loka.zoo"] = None
    from loka.dispatch import CostModel, benchmark, load_probe_tables, make_plan, site_shapes
    from loka.dispatch.report import write_report

    tables = load_probe_tables(sys.argv[1])
    bench = benchmark(site_shapes(tables["sites"]), cost_model=CostModel.shipped(), device="cpu")
    plan = make_plan(tables["sites"], tables["site_errors"], bench.table)
    plan.write(sys.argv[1] + "/plan.parquet")
    write_report(sys.argv[1] + "/report.html", sites=tables["sites"],
                 site_errors=tables["site_errors"], plan=plan.table, kernel_bench=bench.table,
                 summary=plan.summary)
    assert "loka.probe" not in [m for m, v in sys.modules.items() if v is not None]
    print(plan.summary.sites, plan.summary.estimated)
    """
)


def test_probe_tables_plan_without_probe_then_apply_and_train(tmp_path) -> None:
    setup = zoo.create("wukong", "tiny", seed=0, batch_size=32)
    config = ProbeConfig(every=1, warmup_steps=0, min_batches=2, rows=32, queue_size=16)
    with Probe(setup.model, config) as probe:
        zoo.train(setup, 3, on_step=lambda step, loss: probe.step())
        probe.save(tmp_path)
    done = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_PROBE, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["13", "True"]
    assert (tmp_path / "report.html").stat().st_size > 10_000

    # The same tables, planned against timings in which FP8 wins at the head's first layer.
    tables = load_probe_tables(tmp_path)
    head = tables["sites"].filter(pl.col("site") == "head.0").row(0, named=True)
    bench = synthetic_kernel_bench([(head["M_p50"], head["K"], head["N"])])
    plan = make_plan(tables["sites"], tables["site_errors"], bench, PlanConfig())
    assert plan.fp8_sites() == ["head.0"]
    reference = zoo.create("wukong", "tiny", seed=0, batch_size=32)
    reference.model.load_state_dict(setup.model.state_dict())
    applied = apply(setup.model, plan)
    assert isinstance(setup.model.get_submodule("head.0"), Fp8Linear)
    torch.manual_seed(0)
    fp8_losses = zoo.train(setup, 2)
    torch.manual_seed(0)
    bf16_losses = zoo.train(reference, 2)
    # Same data, same start: FP8 in one layer moves the loss by far less than training does.
    assert all(abs(a - b) < 0.02 for a, b in zip(fp8_losses, bf16_losses, strict=True))
    applied.undo()
    assert type(setup.model.get_submodule("head.0")) is torch.nn.Linear
