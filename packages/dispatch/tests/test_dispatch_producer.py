"""A compiled plan costs a forward's quantization of x as inductor runs it: fused into the
op that computed x (`sites.producer`), from the bench's producer rows, not standalone."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from loka.dispatch.bench import Shape, benchmark, site_producer_shapes
from loka.dispatch.bench.candidates import producer_kind
from loka.dispatch.bench.timing import producer_then_quantize, run_producer
from loka.dispatch.planner import PlanConfig, make_plan
from loka.kernels.native import quantize_native
from loka.schema import PASSES, validate

DEVICE = {
    "device": "NVIDIA H200", "capability": "9.0", "driver": "d", "torch_version": "t",
    "triton_version": "r",
}  # fmt: skip
ROW, E5_ROW = "e4m3:e4m3/row/dynamic", "e5m2:e4m3/row/dynamic"
M, K, N = 16384, 4096, 2048


def _sites(producer: str | None, grad_producer: str | None = None) -> pl.DataFrame:
    row = {"site": "fc2", "kind": "linear", "K": K, "N": N, "M_min": M, "M_p50": M, "M_max": M,
           "calls": 1, "groups": 1, "has_bias": False, "dtype": "bfloat16", "fwd_ms": None,
           "bwd_ms": None, "time_share": None, "producer": producer,
           "grad_producer": grad_producer}  # fmt: skip
    overrides = {"fwd_ms": pl.Float64, "bwd_ms": pl.Float64, "time_share": pl.Float64,
                 "producer": pl.String, "grad_producer": pl.String}  # fmt: skip
    return validate(pl.DataFrame([row], schema_overrides=overrides), "sites")


def _errors() -> pl.DataFrame:
    rows = [
        {"site": "fc2", "recipe": ROW, "pass": p, "n": 60, "mean_rel_err": 0.02,
         "std_rel_err": 0.001, "lcb_rel_err": 0.019, "ucb_rel_err": 0.021, "sqnr_db": 30.0,
         "max_abs_err": 0.1, "bf16_rel_err": 0.003, "budget": 0.06, "confidence": 0.95,
         "method": "student-t", "verdict": "safe", "emulated": True, "step_last": 9}
        for p in PASSES
    ]  # fmt: skip
    return validate(pl.DataFrame(rows), "site_errors")


def _bench(producer_rows: bool = True) -> pl.DataFrame:
    """fc2's forward as DHEN xl's measured on the H100: bf16 0.3645 ms; FP8 0.3527 ms, of
    which 0.2 ms GEMM and 0.1527 ms quantizing x and W; standalone quantization of x 0.13
    ms; GELU alone 0.10 ms, GELU fused with quantizing its output 0.15 ms."""

    def row(backend, recipe, pass_, n, median, gemm, quant):
        return {**DEVICE, "backend": backend, "recipe": recipe, "pass": pass_, "M_bucket": M,
                "K": K, "N": n, "groups": 1, "median_ms": median, "tflops": 1.0,
                "estimated": False, "gemm_ms": gemm, "quant_ms": quant}  # fmt: skip

    rows = [row("torch.bf16", "bf16", p, N, 0.3645, 0.3645, 0.0) for p in PASSES]
    rows.append(row("torch.native", ROW, "fwd", N, 0.3527, 0.2, 0.1527))
    if producer_rows:
        rows += [
            row("inductor.quantize", ROW, "fwd", 0, 0.13, 0.13, 0.0),
            row("inductor.pointwise", "bf16", "fwd", 0, 0.10, 0.10, 0.0),
            row("inductor.pointwise+quantize", ROW, "fwd", 0, 0.15, 0.15, 0.0),
        ]
    return validate(pl.DataFrame(rows), "kernel_bench")


def _fwd(plan) -> dict:
    return next(r for r in plan.table.iter_rows(named=True) if r["pass"] == "fwd")


def test_a_compiled_forward_fed_by_gelu_pays_the_fused_quantization() -> None:
    plan = make_plan(_sites("gelu"), _errors(), _bench(), PlanConfig(mode="compiled"))
    fwd = _fwd(plan)
    # 0.2 GEMM + (0.1527 - 0.13) the weight's quantization + (0.15 - 0.10) fused: 0.2727 ms.
    assert fwd["recipe"] == ROW and fwd["predicted_ms"] == pytest.approx(0.2727)
    assert "fused into the gelu computing x" in fwd["reason"]
    assert "0.08 ms less than standalone" in fwd["reason"]
    (note,) = [n for n in plan.summary.notes if "fused into the op computing it" in n]
    assert note.startswith("1 FP8 pass(es) (1 fwd, 0 dgrad) costed") and "0.08 ms less" in note


def test_a_compiled_dgrad_whose_dy_comes_from_gelu_backward_pays_the_fused_quantization():
    def row(backend, recipe, median, gemm=None, quant=0.0, n=0, pass_="dgrad", k=N):
        return {**DEVICE, "backend": backend, "recipe": recipe, "pass": pass_, "M_bucket": M,
                "K": k, "N": n, "groups": 1, "median_ms": median, "tflops": 1.0,
                "estimated": False, "gemm_ms": median if gemm is None else gemm,
                "quant_ms": quant}  # fmt: skip

    # fc1's dgrad: bf16 0.3645 ms; FP8 0.36 = 0.2 GEMM + 0.16 quantizing dY[M, N] and
    # W^T; dY alone 0.13; GELU backward 0.10, with the quantization 0.13.
    extra = [
        row("torch.native", E5_ROW, 0.36, 0.2, 0.16, n=N, k=K),
        row("inductor.quantize", E5_ROW, 0.13), row("inductor.pointwise", "bf16", 0.10),
        row("inductor.pointwise+quantize", E5_ROW, 0.13),
    ]  # fmt: skip
    bench = pl.concat([_bench(producer_rows=False), validate(pl.DataFrame(extra), "kernel_bench")])
    errors = _errors().with_columns(
        recipe=pl.when(pl.col("pass") == "dgrad").then(pl.lit(E5_ROW)).otherwise("recipe")
    )
    for grad_producer, recipe, ms in (("gelu", E5_ROW, 0.26), ("addmm", "bf16", 0.3645)):
        plan = make_plan(_sites(None, grad_producer), errors, bench, PlanConfig(mode="compiled"))
        dgrad = next(r for r in plan.table.iter_rows(named=True) if r["pass"] == "dgrad")
        # 0.2 GEMM + (0.16 - 0.13) W^T's quantization + (0.13 - 0.10) fused: 0.26 ms; a
        # GEMM's dgrad making dY: 0.36 standalone, not 1.05x faster than bf16
        assert dgrad["recipe"] == recipe and dgrad["predicted_ms"] == pytest.approx(ms)
    assert (
        "dY's quantization costed fused into the gelu computing dY"
        in make_plan(_sites(None, "gelu"), errors, bench, PlanConfig(mode="compiled")).table.filter(
            pl.col("pass") == "dgrad"
        )["reason"][0]
    )


@pytest.mark.parametrize(
    ("producer", "config", "bench"),
    [
        ("gelu", PlanConfig(mode="compiled", fuse_into_producer=False), _bench()),
        ("gelu", PlanConfig(mode="compiled"), _bench(producer_rows=False)),  # rows missing
        ("addmm", PlanConfig(mode="compiled"), _bench()),  # a GEMM: nothing to fuse into
        (None, PlanConfig(mode="compiled"), _bench()),
    ],
    ids=["switched-off", "no-rows", "gemm-producer", "no-producer"],
)
def test_otherwise_the_quantization_is_costed_standalone(producer, config, bench) -> None:
    plan = make_plan(_sites(producer), _errors(), bench, config)
    fwd = _fwd(plan)
    assert not any("fused into the op computing it" in n for n in plan.summary.notes)
    # 0.3527 ms standalone is not 1.05x faster than bf16's 0.3645 ms: the pass stays bf16.
    assert fwd["recipe"] == "bf16"
    rejected = {r["backend"]: r["reason"] for r in fwd["rejected"]}
    assert rejected["torch.native"].startswith("not 1.05x faster than bf16: 0.3527 ms")


def test_an_eager_plan_never_counts_on_inductor_fusing() -> None:
    plan = make_plan(_sites("gelu"), _errors(), _bench(), PlanConfig(mode="eager"))
    assert "fused into" not in _fwd(plan)["reason"]


def test_producers_are_classed_as_inductor_fuses_them() -> None:
    # a copy too (InterFormer's gates read a clone): inductor fuses the quantization into it
    assert producer_kind("gelu") == producer_kind("mul") == producer_kind("clone") == "pointwise"
    assert producer_kind("native_layer_norm") == "norm"
    assert producer_kind("addmm") is producer_kind("cat") is producer_kind(None) is None
    sites = pl.concat([_sites("gelu"), _sites("addmm").with_columns(site=pl.lit("fc3"))])
    assert site_producer_shapes(sites) == [(M, K, "pointwise", "fwd")]
    fed_back = _sites(None, grad_producer="native_layer_norm")
    assert site_producer_shapes(fed_back) == [(M, N, "norm", "dgrad")]
    old = sites.drop("producer", "grad_producer")  # a table before schema version 3
    assert site_producer_shapes(old) == []


@pytest.mark.parametrize("kind", ["pointwise", "norm"])
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_the_timed_fused_op_computes_the_op_and_its_quantization(kind, granularity) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    w, b = torch.rand(32, dtype=torch.bfloat16) + 0.5, torch.randn(32, dtype=torch.bfloat16)
    y, (data, inv_scale) = producer_then_quantize(kind, x, w, b, "e4m3", granularity)
    expected = F.gelu(x) if kind == "pointwise" else F.layer_norm(x, (32,), w, b)
    assert torch.equal(y, expected) and torch.equal(run_producer(kind, x, w, b), expected)
    ref_data, ref_scale = quantize_native(expected, "e4m3", granularity)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(inv_scale, ref_scale)
    with pytest.raises(ValueError, match="producer kind must be one of"):
        run_producer("softmax", x, w, b)


def test_benchmark_times_the_producer_rows_once_per_shape() -> None:
    recipes = {"fwd": [ROW, "e4m3:e4m3/row/dynamic/center"], "dgrad": [E5_ROW], "wgrad": []}
    result = benchmark(
        [Shape(32, 64, 32)], recipes=recipes, time_on_cpu=True, backends=["torch.native"],
        producer_shapes=[(32, 64, "pointwise", "fwd"), (30, 64, "pointwise", "fwd"),
                         (32, 64, "norm", "fwd"), (32, 32, "pointwise", "dgrad")],
    )  # fmt: skip
    rows = result.table.filter(pl.col("N") == 0)
    got = sorted(zip(rows["backend"], rows["recipe"], rows["pass"], rows["K"], strict=True))
    # No centered row: inductor does not fuse a centering's mean into the op.
    assert got == [
        ("inductor.norm", "bf16", "fwd", 64), ("inductor.norm+quantize", ROW, "fwd", 64),
        ("inductor.pointwise", "bf16", "dgrad", 32), ("inductor.pointwise", "bf16", "fwd", 64),
        ("inductor.pointwise+quantize", ROW, "fwd", 64),
        ("inductor.pointwise+quantize", E5_ROW, "dgrad", 32),
        ("inductor.quantize", ROW, "fwd", 64), ("inductor.quantize", E5_ROW, "dgrad", 32),
    ]  # fmt: skip
    assert (rows["median_ms"] > 0).all() and not rows["estimated"].any()
    assert rows["host_ms"].is_null().all()
    with pytest.raises(ValueError, match=r"kind must be one of .* and pass fwd or dgrad"):
        benchmark([], time_on_cpu=True, producer_shapes=[(32, 64, "softmax", "fwd")])
    with pytest.raises(ValueError, match="got 'norm', 'wgrad'"):
        benchmark([], producer_shapes=[(32, 64, "norm", "wgrad")])
