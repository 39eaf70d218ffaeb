"""Build the shipped H200 `kernel_bench` table from recorded H200 measurements.

    python bench/shipped.py     # rewrites loka-dispatch's data/h200_kernel_bench.parquet

It is the cost model's table for the H200 when no H200 is present; the table ships in the
package, this script and its sources stay in the repository. Sources (copied into
`bench/shipped_sources/`, measured on one H200, torch 2.11, triton 3.6, CUDA 13.0):
- `kernel_bench_h200_*.parquet` (`bench/dispatch_table.py`): every candidate (backend x
  recipe x pass) timed by `loka.dispatch.benchmark` at the site shapes of the zoo's large
  DLRM, DHEN, Wukong and HSTU models. These rows are shipped as measured
  (`estimated=False`) and replace any derived row with the same key;
- `h200_gemm_bf16_vs_fp8_2026-11-29.csv` (the project's anchors): bf16 and pre-quantized
  `torch._scaled_mm` (tensorwise, rowwise) GEMM times at 32 shapes, M 2k-128k, K,N 256-8k;
- `kernels_quick_*.csv` (`bench/kernels.py --quick`): LoKA's quantization kernels (with
  CUDA-graph times), each FP8 GEMM backend and the backward GEMMs at 2 shapes.

The derived rows below widen the table to the anchors' 32 generic shapes (M 2k-128k) so
that the cost model extrapolates from more than the zoo's shapes. How each derived row is
made (the `source` column says which rule; only rule 1 is a direct measurement of the
row's quantity, so only those rows, with the measured table's, have `estimated=False`):
1. bf16 fwd: the anchor's bf16 GEMM time at (M, K, N).
2. bf16 dgrad, wgrad: the anchor's bf16 GEMM of equal flops, (M, N, K) for dgrad (the
   dgrad GEMM's own dims) and (M, K, N) for wgrad.
3. FP8 GEMM of `torch.scaled_mm`: the anchor's pre-quantized tensorwise or rowwise time at
   the pass's GEMM dims (as in 2); e5m2 operands are taken to cost what e4m3 ones do (the
   kernels run measured 0.202 vs 0.211 ms at 8192x4096x4096).
4. FP8 GEMM of the Triton backends: rule 3's time times the backend's measured ratio to
   `torch._scaled_mm` in the kernels run (same pass and granularity; the run's shape with the
   nearer K), or the measured time itself at the run's own shapes.
6. Norm rows (N = 0; `torch.layer_norm` and `loka.norm_quantize` with the normed output
   kept): the kernels run's CUDA-graph times at 8192x1024 (20.7 and 16.1 us), scaled to each
   anchor (M, K) by elements above the fitted per-kernel overhead t0.
5. Quantization: a bandwidth model ``t = kernels * t0 + bytes / bandwidth`` fitted on the
   kernels run's CUDA-graph times of `quantize` (tensor 12.4 us, row 7.8 us, block 7.2 us at
   8192x1024); bytes per element by operation (a tensorwise amax pass reads the input once
   more; a transpose-quantization writes two outputs; delayed scaling skips the amax pass).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import polars as pl
from scipy.optimize import nnls

from loka.dispatch.bench.candidates import (
    DEFAULT_TIMING_RECIPES,
    LAYER_NORM_BACKEND,
    NORM_QUANTIZE_BACKEND,
    candidates,
    fusable,
)
from loka.kernels.registry import gemm_dims
from loka.schema import Recipe, read_table, validate, write_table

DEVICE = {
    "device": "NVIDIA H200",
    "capability": "9.0",
    "driver": "unknown / CUDA 13.0",
    "torch_version": "2.11.0+cu130",
    "triton_version": "3.6.0",
}
ANCHORS = "h200_gemm_bf16_vs_fp8_2026-11-29.csv"
KERNELS = "kernels_quick_20261129T201612Z.csv"
MEASURED = "kernel_bench_h200_20261129T224545Z.parquet"
_KEY = ["backend", "recipe", "pass", "M_bucket", "K", "N", "groups"]
BACKENDS = ("torch.bf16", "torch.scaled_mm", "triton.fp8", "triton.fp8.tma")

# (kernels launched, bytes moved per element of a bf16 input) of each quantization.
_QUANT_COST = {
    ("q", "tensor", "dynamic"): (2, 5),  # amax read, then read + 1-byte write
    ("q", "tensor", "delayed"): (1, 3),
    ("q", "row", "dynamic"): (1, 3),
    ("q", "block", "dynamic"): (1, 3),
    ("qt", "tensor", "dynamic"): (2, 6),  # amax read, read, two 1-byte writes
    ("qt", "tensor", "delayed"): (1, 4),
    ("qt", "row", "dynamic"): (2, 6),  # row and column amax in one read, then read + 2 writes
    ("qt", "block", "dynamic"): (1, 4),
}


SOURCES = Path(__file__).resolve().parent / "shipped_sources"
# The package data of loka-dispatch that CostModel.shipped() reads.
SHIPPED = (
    Path(__file__).resolve().parents[1]
    / "packages/dispatch/src/loka/dispatch/data/h200_kernel_bench.parquet"
)


def _sources_dir() -> Path:
    return SOURCES


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def fit_quant_model(kernel_rows: list[dict[str, str]]) -> tuple[float, float]:
    """(t0 ms per kernel, ms per byte) from the CUDA-graph times of `quantize`."""
    design, times = [], []
    for row in kernel_rows:
        if row["section"] != "fwd" or not row["path"].startswith("quantize x "):
            continue
        graph_ms = float(row["t_graph_ms"] or "nan")
        if not math.isfinite(graph_ms):
            continue
        gran = row["path"].rsplit(" ", 1)[1]
        kernels, per_elem = _QUANT_COST[("q", gran, "dynamic")]
        elements = int(row["M"]) * int(row["K"])
        design.append([kernels, per_elem * elements])
        times.append(graph_ms)
    if len(times) < 2:
        raise ValueError("the kernels run needs CUDA-graph quantize times at two or more rows")
    coef, _ = nnls(np.array(design, dtype=float), np.array(times))
    return float(coef[0]), float(coef[1])


def quant_ms(model: tuple[float, float], pass_: str, recipe: Recipe, M: int, K: int, N: int):
    t0, per_byte = model
    ops = {
        "fwd": [("q", M * K)],
        "dgrad": [("q", M * N)],
        "wgrad": [("qt", M * N), ("qt", M * K)],
    }[pass_]
    total = 0.0
    for op, elements in ops:
        kernels, per_elem = _QUANT_COST[(op, recipe.granularity, recipe.scaling)]
        total += kernels * t0 + per_elem * elements * per_byte
    return total


class _Anchors:
    def __init__(self, rows: list[dict[str, str]]) -> None:
        self.rows = {(int(r["M"]), int(r["K"]), int(r["N"])): r for r in rows}

    def shapes(self) -> list[tuple[int, int, int]]:
        return list(self.rows)

    def time(self, column: str, m: int, k: int, n: int) -> float | None:
        row = self.rows.get((m, k, n))
        return None if row is None else float(row[column])


def _triton_ratios(kernel_rows: list[dict[str, str]]) -> dict[tuple, dict[int, float]]:
    """{(backend, pass, granularity): {K: Triton GEMM time / torch._scaled_mm time}}, from
    the kernels run (the gemm section for fwd, the bwd section for dgrad and wgrad)."""
    times: dict[tuple, float] = {}
    for row in kernel_rows:
        if row["section"] not in ("gemm", "bwd") or row["ok"] != "True":
            continue
        if row["pass"] not in ("fwd", "dgrad", "wgrad") or "+" in row["path"]:
            continue
        gran = row["recipe"].rsplit("/", 1)[-1]
        times[(row["backend"], row["pass"], gran, int(row["K"]))] = float(row["t_ms"])
    ratios: dict[tuple, dict[int, float]] = {}
    for (backend, pass_, gran, k), t in times.items():
        if not backend.startswith("triton."):
            continue
        # Block scales have no cuBLAS counterpart: compare with rowwise scaled_mm.
        ref = times.get(("torch.scaled_mm", pass_, "row" if gran == "block" else gran, k))
        if ref:
            ratios.setdefault((backend, pass_, gran), {})[k] = t / ref
    return ratios


def build_shipped_table(
    anchors_csv: Path | None = None,
    kernels_csv: Path | None = None,
    measured_table: Path | None = None,
) -> pl.DataFrame:
    """The H200 kernel_bench table: the measured table's rows, then the rows derived (as
    described in this module's documentation) at keys the measured table lacks."""
    measured_table = measured_table or _sources_dir() / MEASURED
    measured = read_table(measured_table, "kernel_bench")
    derived = _derived_table(anchors_csv, kernels_csv)
    devices = set(measured["device"]) | set(derived["device"])
    if devices != {DEVICE["device"]}:
        raise ValueError(
            f"{measured_table}: rows of {sorted(devices)}, expected {DEVICE['device']}"
        )
    # One machine identity for the whole table: the measured run's (the derived rows come
    # from the same GPU model and software versions, their driver was not recorded).
    identity = measured.select(
        ["device", "capability", "driver", "torch_version", "triton_version"]
    ).row(0, named=True)
    derived = derived.join(measured.select(_KEY), on=_KEY, how="anti").with_columns(
        [pl.lit(v).alias(k) for k, v in identity.items()]
    )
    table = pl.concat([measured, derived.select(measured.columns)], how="vertical")
    return validate(table, "kernel_bench", source="shipped H200 table")


def _derived_table(anchors_csv: Path | None, kernels_csv: Path | None) -> pl.DataFrame:
    anchors_csv = anchors_csv or _sources_dir() / ANCHORS
    kernels_csv = kernels_csv or _sources_dir() / KERNELS
    anchors = _Anchors(_read_csv(anchors_csv))
    kernel_rows = _read_csv(kernels_csv)
    qmodel = fit_quant_model(kernel_rows)
    ratios = _triton_ratios(kernel_rows)
    measured_gemm = {
        (r["backend"], r["pass"], r["recipe"].rsplit("/", 1)[-1], int(r["M"]), int(r["K"]),
         int(r["N"])): float(r["t_ms"])
        for r in kernel_rows
        if r["section"] in ("gemm", "bwd") and r["ok"] == "True" and "+" not in r["path"]
    }  # fmt: skip
    rows = []
    for M, K, N in anchors.shapes():
        for status in candidates(M, K, N, DEFAULT_TIMING_RECIPES, backends=BACKENDS):
            if status.refusal is not None:
                continue
            c = status.candidate
            recipe = Recipe.parse(c.recipe)
            m, k, n = gemm_dims(c.pass_, M, K, N)
            # The anchors' (M, K, N) is an NT GEMM with M rows: wgrad's (N, M, K) is timed at
            # the forward's dims, which have the same flops.
            am, ak, an = (M, K, N) if c.pass_ == "wgrad" else (m, k, n)
            if recipe.is_bf16:
                gemm = anchors.time("t_bf16_ms", am, ak, an)
                source = "anchor bf16 GEMM" if c.pass_ == "fwd" else "anchor bf16 GEMM, equal flops"
                q = 0.0
            else:
                col = (
                    "t_fp8_tensorwise_ms" if recipe.granularity == "tensor" else "t_fp8_rowwise_ms"
                )
                gemm = anchors.time(col, am, ak, an)
                source = "anchor scaled_mm GEMM"
                if c.backend.startswith("triton."):
                    direct = measured_gemm.get((c.backend, c.pass_, recipe.granularity, M, K, N))
                    by_k = ratios.get((c.backend, c.pass_, recipe.granularity))
                    if direct is not None:
                        gemm, source = direct, "kernels-run GEMM"
                    elif by_k and gemm is not None:
                        nearest = min(by_k, key=lambda kk: abs(math.log2(kk / K)))
                        gemm *= by_k[nearest]
                        source = f"anchor scaled_mm x kernels-run ratio {by_k[nearest]:.2f}"
                    else:
                        continue  # nothing recorded for this backend and pass
                q = quant_ms(qmodel, c.pass_, recipe, M, K, N)
                source += " + quantization bandwidth model"
            if gemm is None:
                continue
            total = gemm + q
            m_, k_, n_ = gemm_dims(c.pass_, M, K, N)
            rows.append(
                {
                    **DEVICE, "backend": c.backend, "recipe": c.recipe, "pass": c.pass_,
                    "M_bucket": M, "K": K, "N": N, "groups": 1, "median_ms": total,
                    "tflops": 2.0 * m_ * k_ * n_ / (total * 1e-3) / 1e12,
                    "estimated": not (recipe.is_bf16 and c.pass_ == "fwd"),
                    "gemm_ms": gemm, "quant_ms": q, "method": "recorded", "source": source,
                }
            )  # fmt: skip
    rows += _norm_rows(kernel_rows, qmodel[0], {(M, K) for M, K, _ in anchors.shapes()})
    return validate(pl.DataFrame(rows), "kernel_bench", source="shipped H200 table")


_NORM_PATHS = {
    LAYER_NORM_BACKEND: "F.layer_norm",
    NORM_QUANTIZE_BACKEND: "ours layernorm+quantize (+bf16 out)",
}


def _norm_rows(
    kernel_rows: list[dict[str, str]], t0: float, shapes: set[tuple[int, int]]
) -> list[dict]:
    measured = {}
    for row in kernel_rows:
        for backend, path in _NORM_PATHS.items():
            if (
                row["section"] == "norm"
                and row["path"] == path
                and row["t_graph_ms"] not in ("", "nan")
            ):
                measured[backend] = (float(row["t_graph_ms"]), int(row["M"]) * int(row["K"]))
    if len(measured) < 2:
        return []
    out = []
    recipes = ["bf16"] + [r for r in DEFAULT_TIMING_RECIPES["fwd"] if fusable(r)]
    for M, K in sorted(shapes):
        for backend, (t_ms, elements) in measured.items():
            for recipe in recipes[:1] if backend == LAYER_NORM_BACKEND else recipes[1:]:
                t = t0 + max(t_ms - t0, 0.0) * (M * K) / elements
                out.append(
                    {
                        **DEVICE, "backend": backend, "recipe": recipe, "pass": "fwd",
                        "M_bucket": M, "K": K, "N": 0, "groups": 1, "median_ms": t, "tflops": 0.0,
                        "estimated": True, "gemm_ms": t, "quant_ms": 0.0, "method": "recorded",
                        "source": "kernels-run norm time at 8192x1024 scaled by elements",
                    }
                )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--anchors", type=Path, default=None)
    parser.add_argument("--kernels", type=Path, default=None)
    parser.add_argument(
        "--measured", type=Path, default=None, help="a bench/dispatch_table.py table"
    )
    parser.add_argument("--out", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    df = build_shipped_table(args.anchors, args.kernels, args.measured)
    sources = ", ".join(
        str(p.name if p else d) for p, d in
        ((args.measured, MEASURED), (args.anchors, ANCHORS), (args.kernels, KERNELS))
    )  # fmt: skip
    write_table(
        df, args.out, "kernel_bench",
        metadata={"producer": "bench/shipped.py", "sources": sources},
    )  # fmt: skip
    print(f"wrote {args.out}: {df.height} rows, {df.filter(~pl.col('estimated')).height} measured")


if __name__ == "__main__":
    main()
