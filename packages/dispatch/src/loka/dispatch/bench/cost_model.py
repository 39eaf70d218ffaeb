"""Estimated kernel times from a recorded `kernel_bench` table of the target GPU.

Used only where the target GPU is absent (or a shape was not measured within the budget);
every estimate is marked `estimated=True`.

Method, per (backend, speed key, pass) and separately for the GEMM and the quantization
part of a row:
1. a roofline fit ``t = c0 + c1 * flops + c2 * bytes`` with non-negative coefficients
   (`scipy.optimize.nnls`) over the group's recorded shapes, which extrapolates sensibly;
2. the fit's log-residual at the recorded shapes, interpolated to the query shape by inverse
   distance weighting in (log2 M, log2 K, log2 N) over the 4 nearest recorded shapes, so
   that recorded shapes are reproduced exactly and their neighbours follow them.
`holdout()` reports the error of this method on each recorded row predicted from the
others (leave one out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import numpy as np
import polars as pl
from scipy.optimize import nnls

from loka.dispatch.bench.candidates import Candidate, speed_key
from loka.dispatch.bench.timing import PassTiming
from loka.dispatch.device import DeviceInfo
from loka.kernels.registry import gemm_dims
from loka.schema import read_table

SHIPPED_TABLE = "h200_kernel_bench.parquet"
_NEIGHBOURS = 4


def _gemm_features(pass_: str, M: float, K: float, N: float) -> tuple[float, float]:
    m, k, n = gemm_dims(pass_, int(M), int(K), int(N))
    return 2.0 * m * k * n, float(m * k + n * k + m * n)


def _quant_features(pass_: str, M: float, K: float, N: float) -> tuple[float, float]:
    # Quantization is memory bound: elements read and written; no flops term.
    elements = {"fwd": M * K, "dgrad": M * N, "wgrad": M * N + M * K}[pass_]
    return 0.0, float(elements)


@dataclass
class _Fit:
    coef: np.ndarray  # c0, c1 (flops), c2 (bytes)
    points: np.ndarray  # [n, 3] log2 shapes
    log_resid: np.ndarray  # [n]

    def predict(self, features: tuple[float, float], point: np.ndarray) -> float:
        base = self.coef[0] + self.coef[1] * features[0] + self.coef[2] * features[1]
        if base <= 0:
            return 0.0
        dist = np.sqrt(((self.points - point) ** 2).sum(axis=1))
        order = np.argsort(dist)[:_NEIGHBOURS]
        if dist[order[0]] < 1e-9:
            correction = self.log_resid[order[0]]
        else:
            weights = 1.0 / dist[order] ** 2
            correction = float((weights * self.log_resid[order]).sum() / weights.sum())
        return float(base * math.exp(correction))


def _fit(features: np.ndarray, times: np.ndarray, points: np.ndarray) -> _Fit | None:
    if len(times) == 0:
        return None
    if not np.any(times > 0):
        return _Fit(np.zeros(3), points, np.zeros(len(times)))
    # Relative least squares: scale each equation by 1/t so small shapes count as much.
    design = np.column_stack([np.ones(len(times)), features]) / times[:, None]
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(design / scale, np.ones(len(times)))
    coef = coef / scale
    base = coef[0] + features @ coef[1:]
    resid = np.where((base > 0) & (times > 0), np.log(np.maximum(times, 1e-12) / base), 0.0)
    return _Fit(coef, points, resid)


class CostModel:
    """Estimates of per-pass times at any shape from a recorded kernel_bench table of one
    device (the shipped H200 table by default: `CostModel.shipped()`)."""

    def __init__(self, table: pl.DataFrame, *, source: str = "in-memory table") -> None:
        devices = table.select("device").unique().to_series().to_list()
        if len(devices) != 1:
            raise ValueError(f"{source}: a cost model needs rows of one device, got {devices}")
        self.table = table
        self.source = source
        first = table.row(0, named=True)
        self.device = DeviceInfo.from_row(first)
        self._fits: dict[tuple[str, str, str], tuple[_Fit | None, _Fit | None]] = {}
        self._rows: dict[tuple[str, str, str], pl.DataFrame] = {}
        keyed = table.with_columns(
            pl.col("recipe").map_elements(speed_key, return_dtype=pl.String).alias("_speed")
        )
        for (backend, key, pass_), rows in keyed.group_by(
            ["backend", "_speed", "pass"], maintain_order=True
        ):
            self._rows[(backend, key, pass_)] = rows

    @classmethod
    def shipped(cls) -> CostModel:
        """The recorded H200 table shipped with loka-dispatch."""
        ref = resources.files("loka.dispatch") / "data" / SHIPPED_TABLE
        with resources.as_file(ref) as path:
            return cls(read_table(path, "kernel_bench"), source=f"shipped {SHIPPED_TABLE}")

    @classmethod
    def from_file(cls, path: str) -> CostModel:
        return cls(read_table(path, "kernel_bench"), source=str(path))

    def groups(self) -> list[tuple[str, str, str]]:
        """(backend, speed key, pass) combinations the model can estimate."""
        return list(self._rows)

    def _group_fits(self, key: tuple[str, str, str], drop: int | None = None):
        if drop is None and key in self._fits:
            return self._fits[key]
        rows = self._rows[key]
        if drop is not None:
            rows = rows.with_row_index("_i").filter(pl.col("_i") != drop)
        M, K, N = (rows[c].to_numpy().astype(float) for c in ("M_bucket", "K", "N"))
        pass_ = key[2]
        # N = 0 marks a norm row (no GEMM): log2 of 1 keeps it finite.
        points = np.log2(np.maximum(np.column_stack([M, K, N]), 1.0))
        gemm = np.array([_gemm_features(pass_, *s) for s in zip(M, K, N, strict=True)])
        quant = np.array([_quant_features(pass_, *s) for s in zip(M, K, N, strict=True)])
        gemm_ms = _column(rows, "gemm_ms", rows["median_ms"])
        quant_ms = _column(rows, "quant_ms", np.zeros(len(rows)))
        fits = (_fit(gemm, gemm_ms, points), _fit(quant, quant_ms, points))
        if drop is None:
            self._fits[key] = fits
        return fits

    def estimate(self, candidate: Candidate, M: int, K: int, N: int) -> PassTiming | None:
        """The estimated time of `candidate` at ``x[M,K] W[N,K]^T`` (None: nothing recorded
        for this backend, recipe kind and pass)."""
        key = (candidate.backend, speed_key(candidate.recipe), candidate.pass_)
        if key not in self._rows:
            return None
        return self._predict(key, self._group_fits(key), candidate.pass_, M, K, N)

    @staticmethod
    def _predict(key, fits, pass_: str, M: int, K: int, N: int) -> PassTiming:
        point = np.log2(np.maximum(np.array([M, K, N], dtype=float), 1.0))
        gemm_fit, quant_fit = fits
        gemm = gemm_fit.predict(_gemm_features(pass_, M, K, N), point)
        quant = quant_fit.predict(_quant_features(pass_, M, K, N), point) if quant_fit else 0.0
        return PassTiming(gemm + quant, gemm, quant, "cost_model")

    def holdout(self) -> pl.DataFrame:
        """Leave-one-out: each recorded row predicted from the other rows of its group (groups
        with at least 4 rows), with the relative error of the total time."""
        out = []
        for key, rows in self._rows.items():
            if len(rows) < 4:
                continue
            for i, row in enumerate(rows.iter_rows(named=True)):
                fits = self._group_fits(key, drop=i)
                pred = self._predict(key, fits, key[2], row["M_bucket"], row["K"], row["N"])
                out.append(
                    {
                        "backend": key[0], "recipe": row["recipe"], "pass": key[2],
                        "M_bucket": row["M_bucket"], "K": row["K"], "N": row["N"],
                        "recorded_ms": row["median_ms"], "predicted_ms": pred.median_ms,
                        "rel_err": pred.median_ms / row["median_ms"] - 1.0,
                        "recorded_estimated": row["estimated"],
                    }
                )  # fmt: skip
        return pl.DataFrame(out)


def _column(rows: pl.DataFrame, name: str, fallback) -> np.ndarray:
    if name in rows.columns:
        values = rows[name].to_numpy().astype(float)
        return np.where(np.isnan(values), np.asarray(fallback, dtype=float), values)
    return np.asarray(fallback, dtype=float)
