"""How long one packed training step takes, fit from profiled steps or a recorded table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from loka.plora.config import LoraJobConfig, pack_rows
from loka.plora.plan.shape import ModelShape

FEATURES = ("n_adapters", "tokens", "rank_tokens")


@dataclass(frozen=True)
class ThroughputModel:
    """Step time of a pack = overhead + per token + per adapter + per (rank x token)
    (+ per token x row length: attention).

    `overhead_s` is what a step costs whatever its size (kernel launches, the frozen base's
    fixed costs), `per_adapter_s` what each job adds (its optimizer step, its slice of the
    launches), `per_token_s` the base model's work per token and `per_rank_token_s` the
    adapters' GEMMs. The model is linear so that packing's gain is explicit: a pack of n
    jobs pays the overhead once instead of n times, and the GPU runs larger GEMMs.

    Tokens are those each job occupies in the packed batch (`loka.plora.config.pack_rows`:
    its own, plus the pads of its rows when the pack mixes lengths). `per_context_token_s`
    charges attention, whose cost per token grows with the row's length: the analytic
    model sets it; a fit on steps profiled at one length cannot tell it from `per_token_s`
    and leaves it at 0 (attention is then charged as at the profiled length).
    """

    overhead_s: float
    per_adapter_s: float
    per_token_s: float
    per_rank_token_s: float
    source: str
    per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        keys = ("overhead_s", "per_adapter_s", "per_token_s", "per_rank_token_s")
        for key in (*keys, "per_context_token_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ThroughputModel.{key} must be finite and >= 0, got {value!r}")
        # Every pack has an adapter, tokens and a rank: one positive term is a step time. (A
        # fit on noisy steps put everything on rank x tokens once; that is a poor model, which
        # its source's max relative error says, not a zero one.)
        if sum(getattr(self, key) for key in (*keys, "per_context_token_s")) <= 0:
            raise ValueError("ThroughputModel predicts zero step time; the fit is degenerate")

    def step_time(self, jobs: Sequence[LoraJobConfig], seq_len: int) -> float:
        """One step with `jobs` active (`seq_len`: the length of jobs without their own)."""
        rows = pack_rows(jobs, seq_len)
        tokens = rows.tokens
        return (
            self.overhead_s
            + self.per_adapter_s * len(jobs)
            + (self.per_token_s + self.per_context_token_s * rows.row_len) * sum(tokens)
            + self.per_rank_token_s * sum(job.rank * t for job, t in zip(jobs, tokens, strict=True))
        )

    def leaving_step_times(self, jobs: Sequence[LoraJobConfig], seq_len: int) -> list[float]:
        """`step_time(jobs[k:], seq_len)` for every k: the step times of a pack whose jobs
        leave in the order given. One pass per distinct row length, not one per k."""
        n = len(jobs)
        lengths = [job.length(seq_len) for job in jobs]
        row_len, longest = [0] * n, 0
        for k in range(n - 1, -1, -1):
            longest = max(longest, lengths[k])
            row_len[k] = longest
        suffix: dict[int, list[float]] = {}
        for r in set(row_len):
            per_token = self.per_token_s + self.per_context_token_s * r
            sums, total = [0.0] * n, 0.0
            for k in range(n - 1, -1, -1):
                job = jobs[k]
                # (jobs longer than r are never in a suffix whose rows are r long)
                tokens = -(-job.batch_size // (r // lengths[k])) * r if lengths[k] <= r else 0
                total += (per_token + self.per_rank_token_s * job.rank) * tokens
                sums[k] = total
            suffix[r] = sums
        return [
            self.overhead_s + self.per_adapter_s * (n - k) + suffix[row_len[k]][k] for k in range(n)
        ]

    @classmethod
    def fit(
        cls, records: Sequence[Mapping[str, Any]], source: str | None = None
    ) -> ThroughputModel:
        """Non-negative least squares on records with `n_adapters`, `tokens`, `rank_tokens`
        and `step_time_s` (e.g. `StepProfile.to_dict()`); relative errors are minimized, so
        small and large packs weigh the same."""
        if len(records) < 2:
            raise ValueError(
                f"fitting a throughput model needs at least 2 profiled steps, got {len(records)}"
            )
        rows, times = [], []
        for n, record in enumerate(records):
            missing = [k for k in (*FEATURES, "step_time_s") if k not in record]
            if missing:
                raise ValueError(f"throughput record {n} lacks {missing}")
            t = float(record["step_time_s"])
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"throughput record {n}: step_time_s must be > 0, got {t!r}")
            rows.append([1.0, *(float(record[k]) for k in FEATURES)])
            times.append(t)
        a, y = np.asarray(rows), np.asarray(times)
        # Dividing each row by its time turns the fit into one of relative errors; columns
        # are scaled to comparable sizes so that nnls is well conditioned.
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(a / scale / y[:, None], np.ones_like(y))
        coef = coef / scale
        fitted = a @ coef
        err = float(np.max(np.abs(fitted - y) / y))
        return cls(
            overhead_s=float(coef[0]),
            per_adapter_s=float(coef[1]),
            per_token_s=float(coef[2]),
            per_rank_token_s=float(coef[3]),
            source=source or f"fit on {len(records)} profiled steps (max relative error {err:.1%})",
        )

    @classmethod
    def from_table(cls, path: str | Path, backend: str = "triton") -> ThroughputModel:
        """Fit on a recorded table (CSV, JSON records or parquet) of profiled steps, e.g.
        `bench/results/plora_steps_*.csv` written by `bench/plora.py` on the GPU. When the
        table has `kind` and `backend` columns (the bench's does), only packed steps of
        `backend` are fit: its baselines are other programs."""
        import polars as pl

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"throughput table {path} does not exist")
        readers = {".csv": pl.read_csv, ".parquet": pl.read_parquet, ".json": pl.read_json}
        if path.suffix not in readers:
            raise ValueError(f"{path}: throughput tables are .csv, .json or .parquet")
        try:
            table = readers[path.suffix](path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # polars errors, and its Rust panics on damaged files
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ValueError(f"{path}: cannot read the throughput table ({first})") from None
        missing = [c for c in (*FEATURES, "step_time_s") if c not in table.columns]
        if missing:
            raise ValueError(f"{path}: throughput table lacks columns {missing}")
        if "kind" in table.columns:
            table = table.filter(pl.col("kind") == "packed")
        if "backend" in table.columns:
            table = table.filter(pl.col("backend") == backend)
        try:
            fitted = cls.fit(table.to_dicts())
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None
        return replace(fitted, source=f"table {path.name} ({backend}): {fitted.source}")

    @classmethod
    def analytic(
        cls,
        shape: ModelShape,
        seq_len: int,
        *,
        peak_flops: float = 989e12,
        efficiency: float = 0.4,
        launch_s: float = 5e-6,
    ) -> ThroughputModel:
        """A rough model from FLOP counts and launch costs, for when no GPU profile exists.

        peak_flops: the GPU's dense bf16 peak (H100/H200 SXM: 989e12); efficiency: the
        fraction of it the GEMMs reach; launch_s: the cost of one kernel launch. LoRA
        training runs the base forward and its input gradient (4 FLOPs per weight per
        token, no weight gradient) plus causal attention; each adapter GEMM costs 6 FLOPs
        per rank per (in + out) per token over its forward and three backward products.
        `seq_len` only names the run's length: attention's cost per token follows each
        pack's row length (`per_context_token_s`).
        """
        linears = shape.linear_shapes()
        base = (
            shape.num_layers * sum(i * o for i, o in linears.values()) + shape.vocab * shape.hidden
        )
        attention = shape.num_layers * 6 * shape.num_heads * shape.head_dim  # x row length
        lora = shape.num_layers * sum(6 * sum(linears[m]) for m in shape.target_modules)
        rate = peak_flops * efficiency
        launches_per_layer = 40 + 12 * len(shape.target_modules)
        return cls(
            overhead_s=shape.num_layers * launches_per_layer * launch_s,
            per_adapter_s=shape.num_layers * len(shape.target_modules) * 4 * launch_s,
            per_token_s=4 * base / rate,
            per_rank_token_s=lora / rate,
            per_context_token_s=attention / rate,
            source=f"analytic estimate ({peak_flops / 1e12:.0f} TFLOP/s peak x {efficiency:.0%}); "
            "not measured",
        )
