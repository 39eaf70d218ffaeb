"""The `sites`, `tensor_stats` and `site_errors` tables from the sites' states."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import polars as pl

from loka.probe.config import ProbeConfig
from loka.probe.state import SiteState
from loka.probe.verdict import METHOD, decide
from loka.schema import SketchRecord, empty, table, tensor_stats_from_sketches, validate

# Columns Probe adds after the schema's own (validate keeps extra columns).
SITES_EXTRA = {
    "captured_steps": pl.Int64(),
    "nonfinite_batches": pl.Int64(),
    "verify_from": pl.Int64(),
    "drift_step": pl.Int64(),
    "drift_reason": pl.String(),
}
ERRORS_EXTRA = {
    "frob_rel_err": pl.Float64(),
    "balanced_rel_err": pl.Float64(),
    "varying_rel_err": pl.Float64(),
    "bf16_varying_rel_err": pl.Float64(),
    "summed_rel_err": pl.Float64(),
    "bf16_summed_rel_err": pl.Float64(),
    "error_part": pl.String(),
    "first_step": pl.Int64(),
}


def _none_if_nan(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _site_row(state: SiteState) -> dict[str, Any]:
    m = np.asarray(state.m_seen, dtype=np.int64)
    timings = np.asarray(state.timings, dtype=np.float64).reshape(-1, 4)
    fwd_ms = bwd_ms = share = None
    if len(timings):
        fwd, bwd, calls, step_ms = timings.T
        fwd_ms = float(fwd.sum() / calls.sum())
        with_bwd = np.isfinite(bwd)
        if with_bwd.any():
            bwd_ms = float(bwd[with_bwd].sum() / calls[with_bwd].sum())
            share = _none_if_nan(float(np.mean((fwd + bwd)[with_bwd] / step_ms[with_bwd])))
    return {
        "site": state.name,
        "kind": state.kind,
        "K": state.K,
        "N": state.N,
        "M_min": int(m.min()) if m.size else 0,
        "M_p50": int(np.median(m)) if m.size else 0,
        "M_max": int(m.max()) if m.size else 0,
        "calls": state.calls,
        "groups": state.groups,
        "has_bias": state.has_bias,
        "dtype": state.dtype or "unknown",
        "fwd_ms": fwd_ms,
        "bwd_ms": bwd_ms,
        "time_share": share,
        "norm": state.norm,
        "producer": state.producer,
        "grad_producer": state.grad_producer,
        "captured_steps": state.captured_steps,
        "nonfinite_batches": state.nonfinite_batches,
        "verify_from": state.verify_from,
        "drift_step": state.drift_step,
        "drift_reason": state.drift_reason,
    }


def _error_rows(state: SiteState, config: ProbeConfig) -> list[dict[str, Any]]:
    rows = []
    for (recipe, pass_), series in state.errors.items():
        keep = series.mask(state.verify_from)
        if not keep.any():
            continue
        bf16 = state.bf16.get(pass_)
        bounds = series.bounds(state.verify_from, config, bf16)
        budget = config.budget(state.name, pass_)
        err_sq = float(np.asarray(series.err_sq)[keep].sum())
        ref_sq = float(np.asarray(series.ref_sq)[keep].sum())
        bf16_err = bf16_varying = bf16_summed = None
        if bf16 is not None and bf16.mask(state.verify_from).any():
            bf16_keep = bf16.mask(state.verify_from)
            bf16_err, bf16_varying, bf16_summed = (
                float(np.asarray(getattr(bf16, f))[bf16_keep].mean())
                for f in ("balanced", "varying", "summed")
            )
        steps = np.asarray(series.steps)[keep]
        rows.append(
            {
                "site": state.name,
                "recipe": recipe,
                "pass": pass_,
                "n": bounds.n,
                "mean_rel_err": bounds.mean,
                "std_rel_err": bounds.std,
                "lcb_rel_err": bounds.lcb,
                "ucb_rel_err": bounds.ucb,
                "sqnr_db": 10 * math.log10(ref_sq / err_sq) if err_sq > 0 else math.inf,
                "max_abs_err": float(np.asarray(series.max_abs)[keep].max()),
                "bf16_rel_err": bf16_err,
                "budget": budget,
                "confidence": config.confidence,
                "method": METHOD,
                "verdict": decide(bounds, budget, config.min_batches),
                "emulated": series.emulated,
                "step_last": int(steps.max()),
                "frob_rel_err": float(np.asarray(series.frobenius)[keep].mean()),
                "balanced_rel_err": float(np.asarray(series.balanced)[keep].mean()),
                "varying_rel_err": float(series.excess(bf16)[keep].mean()),
                "bf16_varying_rel_err": bf16_varying,
                "summed_rel_err": float(series.excess(bf16, "summed")[keep].mean()),
                "bf16_summed_rel_err": bf16_summed,
                "error_part": series.largest_part(keep, bf16, config),
                "first_step": int(steps.min()),
            }
        )
    return rows


def _frame(rows: list[dict[str, Any]], name: str, extra: dict[str, pl.DataType]) -> pl.DataFrame:
    schema = {**table(name).schema, **extra}
    if not rows:
        return validate(
            empty(name).with_columns(pl.lit(None, dtype=t).alias(c) for c, t in extra.items()), name
        )
    return validate(pl.DataFrame(rows, schema=schema), name)


def build_tables(states: Iterable[SiteState], config: ProbeConfig) -> dict[str, pl.DataFrame]:
    states = list(states)
    records = [
        SketchRecord(s.name, role, window, w.step_first, w.step_last, w.samples, w.sketch)
        for s in states
        for (role, window), w in sorted(s.windows.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]
    stats = tensor_stats_from_sketches(records) if records else empty("tensor_stats")
    errors = [row for s in states for row in _error_rows(s, config)]
    return {
        "sites": _frame([_site_row(s) for s in states], "sites", SITES_EXTRA),
        "tensor_stats": validate(stats, "tensor_stats"),
        "site_errors": _frame(errors, "site_errors", ERRORS_EXTRA),
    }
