"""The H200 `kernel_bench` table LoKA ships: every candidate (backend x recipe x pass) timed
at the site shapes of the zoo's large DLRM, DHEN, Wukong and HSTU models.

Shapes come from one forward pass of each large model (M: rows each linear sees at the
preset's batch, bucketed to a power of two). Timing is `loka.dispatch.benchmark`: per pass,
the operand quantization and the GEMM, each the median of CUDA-graph replays over rotating
inputs; measured rows go to the cache (`--cache`), so a second run only fills gaps. Shapes
past `--budget-s` are left out (listed in the JSON), never invented.

    python bench/dispatch_table.py --smoke     # CPU: tiny presets, Triton interpreter, < 1 min
    python bench/dispatch_table.py             # GPU: ~3 minutes
To ship it: copy `kernel_bench_h200_<time>.parquet` over
packages/dispatch/src/loka/dispatch/data/h200_kernel_bench.parquet (the cost model then fits
measured rows; `CostModel.shipped().holdout()` gives its leave-one-out error).
Results in --out (default $OUT, else bench/results/): the parquet table, a CSV of it, and a
JSON with the command, device, versions, shapes and per-shape best FP8 speedups per pass.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from harness import metadata, parser, write_json
from harness import stamp as utc_stamp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)  # --out, --budget-s (timing budget: 170 s; smoke 40)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny presets, one shape")
    p.add_argument("--models", default="dlrm,dhen,wukong,hstu")
    p.add_argument("--cache", default=None, help="kernel_bench cache folder (~/.cache/loka)")
    return p.parse_args(argv)


import torch  # noqa: E402

if not torch.cuda.is_available():  # before any @triton.jit is created
    os.environ.setdefault("TRITON_INTERPRET", "1")

import polars as pl  # noqa: E402

from loka.dispatch.bench import BenchCache, benchmark  # noqa: E402
from loka.dispatch.bench.runner import Shape  # noqa: E402
from loka.dispatch.workloads import norm_shapes_of, shapes_of, zoo_shapes  # noqa: E402
from loka.schema import write_table  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.monotonic()
    gpu = torch.cuda.is_available()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = tuple(args.models.split(","))
    if args.smoke:
        per_model = zoo_shapes(("dhen",), preset="tiny", device="cpu", cpu_batch=32)
        shapes, norm_shapes = [Shape(32, 32, 64)], [(32, 32)]
        budget = args.budget_s or 40.0
    else:
        per_model = zoo_shapes(names, preset="large")
        shapes, norm_shapes = shapes_of(per_model), norm_shapes_of(per_model)
        budget = args.budget_s or 170.0
    print(f"[dispatch_table] {len(shapes)} distinct shapes from {', '.join(per_model)}", flush=True)
    cache = BenchCache(args.cache)

    def progress(done: int, total: int, detail: str) -> None:
        if done % 50 == 0 or done == total:
            print(f"  {done}/{total} {detail} ({time.monotonic() - start:.0f} s)", flush=True)

    result = benchmark(shapes, cache=cache, budget_s=budget, progress=progress,
                       time_on_cpu=not gpu, norm_shapes=norm_shapes)  # fmt: skip
    table = result.table
    stamp = utc_stamp()
    tag = "h200" if "H200" in result.device.device else result.device.slug
    path = out / f"kernel_bench_{tag}_{'smoke_' if args.smoke else ''}{stamp}.parquet"
    write_table(table, path, "kernel_bench", metadata={"device": result.device.describe(),
                                                        "producer": "bench/dispatch_table.py"})  # fmt: skip
    table.write_csv(path.with_suffix(".csv"))
    best = summarize(table)
    meta = metadata(
        "cuda" if gpu else "cpu", date_utc=stamp, device=result.device.as_dict(),
        timing="per pass: quantization + GEMM, each a median of CUDA-graph replays over "
        "rotating inputs (wall clock under the CPU interpreter in --smoke: not a speed)",
        shapes=[s.__dict__ for s in shapes], norm_shapes=norm_shapes,
        site_shapes=per_model,
        measured=result.measured, reused=result.reused, estimated=result.estimated,
        refused=[(s.__dict__, c.__dict__, r) for s, c, r in result.refused],
        failed=[(s.__dict__, c.__dict__, r) for s, c, r in result.failed],
        notes=result.notes, best_fp8_speedup=best, wall_s=time.monotonic() - start,
    )  # fmt: skip
    write_json(path.with_suffix(".json"), meta)
    print(f"wrote {path} (+ .csv, .json): {table.height} rows, {result.measured} measured, "
          f"{result.reused} cached, {len(result.failed)} failed/over budget, "
          f"{time.monotonic() - start:.0f} s")  # fmt: skip


def summarize(table: pl.DataFrame) -> list[dict]:
    """Per shape and pass: bf16 time, the fastest FP8 candidate and its speedup."""
    rows = []
    print(
        f"\n{'M':>7} {'K':>6} {'N':>6} {'pass':<6} {'bf16 ms':>8} {'best FP8':<44} {'x bf16':>7} {'GEMM only':>9}"
    )
    gemms = table.filter(pl.col("N") > 0)
    for (M, K, N, pass_), part in gemms.group_by(
        ["M_bucket", "K", "N", "pass"], maintain_order=True
    ):
        bf16 = part.filter(pl.col("recipe") == "bf16")
        fp8 = part.filter(pl.col("recipe") != "bf16").sort("median_ms")
        if bf16.is_empty() or fp8.is_empty():
            continue
        b, f = bf16.row(0, named=True), fp8.row(0, named=True)
        best = {"M": M, "K": K, "N": N, "pass": pass_, "bf16_ms": b["median_ms"],
                "backend": f["backend"], "recipe": f["recipe"], "fp8_ms": f["median_ms"],
                "speedup": b["median_ms"] / f["median_ms"],
                "gemm_only_speedup": b["median_ms"] / f["gemm_ms"]}  # fmt: skip
        rows.append(best)
        print(f"{M:>7} {K:>6} {N:>6} {pass_:<6} {b['median_ms']:>8.4f} "
              f"{f['backend'] + ' ' + f['recipe']:<44} {best['speedup']:>7.2f} "
              f"{best['gemm_only_speedup']:>9.2f}")  # fmt: skip
    norms = table.filter(pl.col("N") == 0)
    for (M, K), part in norms.group_by(["M_bucket", "K"], maintain_order=True):
        ln = part.filter(pl.col("backend") == "torch.layer_norm")
        fused = part.filter(pl.col("backend") == "loka.norm_quantize").sort("median_ms")
        if ln.height and fused.height:
            a, b = ln["median_ms"][0], fused["median_ms"][0]
            rows.append({"M": M, "K": K, "pass": "norm", "bf16_ms": a, "fused_ms": b})
            print(f"{M:>7} {K:>6} {'norm':>6} LayerNorm {a:.4f} ms, fused norm+quantize {b:.4f} ms")
    return rows


if __name__ == "__main__":
    main()
