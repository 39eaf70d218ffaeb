"""What Probe has learned about each site, in a form that merges exactly across ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loka.probe.gemm_error import (
    BAL_DEN,
    BAL_NUM,
    ERR_SQ,
    MAX_ABS,
    REF_SQ,
    SUM_DEN,
    SUM_NUM,
    VAR_DEN,
    VAR_NUM,
)
from loka.probe.verdict import Bounds, decide, mean_bounds
from loka.stats import Sketch

_SERIES_FIELDS = (
    "steps", "balanced", "frobenius", "ref_sq", "err_sq", "max_abs", "varying", "summed"
)  # fmt: skip
# Fields a series saved before they existed lacks: its balanced errors stand in.
_LATER_FIELDS = ("varying", "summed")


@dataclass
class ErrorSeries:
    """Per-batch errors of one (site, recipe, pass), in step order.

    A batch's error, the one the bounds and verdicts read (`errors`), is the largest of
    its balanced error, its *varying excess* divided by `ProbeConfig.varying_allowance`
    and its *summed excess* divided by `ProbeConfig.summed_allowance`. An excess is how
    much the recipe adds, beyond the bf16 GEMM of the same batch, to the error of the
    output's token-to-token variation (varying) or of its sum over the tokens (summed,
    dgrad), ``sqrt(max(0, e^2 - e_bf16^2))``: the bf16 GEMM's share is taken out because
    its output rounding, the same in every recipe, is no cost of FP8; the squares
    subtract because the two roundings are independent."""

    steps: list[int] = field(default_factory=list)
    balanced: list[float] = field(default_factory=list)
    frobenius: list[float] = field(default_factory=list)
    ref_sq: list[float] = field(default_factory=list)
    err_sq: list[float] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)
    varying: list[float] = field(default_factory=list)
    summed: list[float] = field(default_factory=list)
    emulated: bool = False

    def add(self, step: int, sums: np.ndarray, emulated: bool) -> None:
        self.steps.append(step)
        self.balanced.append(float(np.sqrt(sums[BAL_NUM] / sums[BAL_DEN])))
        self.frobenius.append(float(np.sqrt(sums[ERR_SQ] / sums[REF_SQ])))
        self.ref_sq.append(float(sums[REF_SQ]))
        self.err_sq.append(float(sums[ERR_SQ]))
        self.max_abs.append(float(sums[MAX_ABS]))
        # An output that does not vary over the batch at all, or sums to zero over it:
        # its balanced error stands in.
        for values, num, den in ((self.varying, VAR_NUM, VAR_DEN), (self.summed, SUM_NUM, SUM_DEN)):
            measured = sums[den] > 0 and np.isfinite(sums[num] / sums[den])
            values.append(float(np.sqrt(sums[num] / sums[den])) if measured else self.balanced[-1])
        self.emulated |= emulated

    def excess(self, bf16: ErrorSeries | None, part: str = "varying") -> np.ndarray:
        """Per batch, the `part` ("varying" or "summed") error beyond bf16's on the same
        step (that error itself where bf16 has no batch of that step, or for the bf16
        series itself)."""
        values = np.nan_to_num(np.asarray(getattr(self, part), dtype=np.float64))
        if bf16 is None or bf16 is self:
            return values
        base = dict(zip(bf16.steps, getattr(bf16, part), strict=True))
        own = np.nan_to_num(np.array([base.get(s, 0.0) for s in self.steps], dtype=np.float64))
        return np.sqrt(np.maximum(values**2 - own**2, 0.0))

    def parts(self, bf16: ErrorSeries | None, config: Any) -> dict[str, np.ndarray]:
        """Per batch, the balanced error and the varying and summed excesses over their
        allowances (`config`: a ProbeConfig)."""
        return {
            "balanced": np.asarray(self.balanced, dtype=np.float64),
            "varying": self.excess(bf16, "varying") / config.varying_allowance,
            "summed": self.excess(bf16, "summed") / config.summed_allowance,
        }

    def errors(self, bf16: ErrorSeries | None, config: Any) -> np.ndarray:
        """Per batch, the error a verdict reads: the largest of `parts`."""
        return np.maximum.reduce(list(self.parts(bf16, config).values()))

    def largest_part(self, keep: np.ndarray, bf16: ErrorSeries | None, config: Any) -> str:
        """The part of `parts` largest on average over the batches `keep`: what the
        verdict's error mostly is."""
        means = {k: float(v[keep].mean()) for k, v in self.parts(bf16, config).items()}
        return max(means, key=means.__getitem__)  # ties: the balanced error first

    def mask(self, first_step: int, last_step: int | None = None) -> np.ndarray:
        steps = np.asarray(self.steps, dtype=np.int64)
        keep = steps >= first_step
        return keep if last_step is None else keep & (steps <= last_step)

    def bounds(self, first_step: int, config: Any, bf16: ErrorSeries | None) -> Bounds:
        """Bounds at `config.confidence` of the errors from `first_step` on."""
        errors = self.errors(bf16, config)
        return mean_bounds(errors[self.mask(first_step)], config.confidence)

    def to_dict(self) -> dict[str, Any]:
        return {**{f: list(getattr(self, f)) for f in _SERIES_FIELDS}, "emulated": self.emulated}

    @classmethod
    def merged(cls, parts: list[dict[str, Any]]) -> ErrorSeries:
        """One series holding every batch of `parts`, ordered by step (ties keep part order)."""
        out = cls()
        rows = sorted(
            ((p["steps"][i], k, i) for k, p in enumerate(parts) for i in range(len(p["steps"]))),
        )
        for _, k, i in rows:
            for f in _SERIES_FIELDS:
                values = (
                    parts[k].get(f, parts[k]["balanced"]) if f in _LATER_FIELDS else parts[k][f]
                )
                getattr(out, f).append(values[i])
        out.emulated = any(p["emulated"] for p in parts)
        return out


@dataclass
class RoleWindow:
    """Statistics of one operand role of a site over one window of steps."""

    sketch: Sketch = field(default_factory=Sketch)
    samples: int = 0
    step_first: int = -1
    step_last: int = -1

    def add(self, step: int) -> None:
        self.samples += 1
        self.step_first = step if self.step_first < 0 else min(self.step_first, step)
        self.step_last = max(self.step_last, step)


@dataclass
class SiteState:
    name: str
    kind: str
    K: int = 0
    N: int = 0
    groups: int = 1
    has_bias: bool = False
    dtype: str = ""
    m_seen: list[int] = field(default_factory=list)
    calls: int = 0
    captured_steps: int = 0
    last_captured: int = -1
    # per timed step: [forward ms, backward ms (NaN if unmeasured), calls, step ms]
    timings: list[list[float]] = field(default_factory=list)
    windows: dict[tuple[str, int], RoleWindow] = field(default_factory=dict)
    errors: dict[tuple[str, str], ErrorSeries] = field(default_factory=dict)
    bf16: dict[str, ErrorSeries] = field(default_factory=dict)
    nonfinite_batches: int = 0
    verify_from: int = 0
    drift_step: int | None = None
    drift_reason: str | None = None
    drift_checked: int = -1  # last window whose drift check ran
    undecided: bool = True
    norm: str | None = None  # the norm whose output feeds this site alone (`loka.probe.norms`)
    norm_traced: bool = False
    producer: str | None = None  # the op that computed this site's input (`loka.probe.norms`)
    grad_producer: str | None = None  # the op whose backward computes its output's gradient

    def window(self, role: str, index: int) -> RoleWindow:
        key = (role, index)
        if key not in self.windows:
            self.windows[key] = RoleWindow()
        return self.windows[key]

    def verdicts(self, config: Any) -> dict[tuple[str, str], tuple[Bounds, str]]:
        out = {}
        for (recipe, pass_), series in self.errors.items():
            bounds = series.bounds(self.verify_from, config, self.bf16.get(pass_))
            budget = config.budget(self.name, pass_)
            out[(recipe, pass_)] = (bounds, decide(bounds, budget, config.min_batches))
        return out

    def refresh_undecided(self, config: Any) -> None:
        verdicts = self.verdicts(config)
        self.undecided = not verdicts or any(v == "undecided" for _, v in verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        plain = {
            k: getattr(self, k)
            for k in (
                "name", "kind", "K", "N", "groups", "has_bias", "dtype", "m_seen", "calls",
                "captured_steps", "last_captured", "timings", "nonfinite_batches",
                "verify_from", "drift_step", "drift_reason", "norm", "norm_traced", "producer",
                "grad_producer",
            )
        }  # fmt: skip
        plain["windows"] = {
            key: (w.sketch.to_bytes(), w.samples, w.step_first, w.step_last)
            for key, w in self.windows.items()
        }
        plain["errors"] = {key: s.to_dict() for key, s in self.errors.items()}
        plain["bf16"] = {key: s.to_dict() for key, s in self.bf16.items()}
        return plain

    @classmethod
    def merged(cls, parts: list[dict[str, Any]]) -> SiteState:
        """The state of one site seen by several ranks (in rank order)."""
        first = parts[0]
        out = cls(first["name"], first["kind"], first["K"], first["N"], first["groups"])
        seen = [p for p in parts if p["dtype"]] or parts
        out.has_bias, out.dtype = seen[0]["has_bias"], seen[0]["dtype"]
        out.K = max(p["K"] for p in parts)
        out.N = max(p["N"] for p in parts)
        for p in parts:
            out.m_seen += p["m_seen"]
            out.calls += p["calls"]
            out.captured_steps += p["captured_steps"]
            out.timings += p["timings"]
            out.nonfinite_batches += p["nonfinite_batches"]
        out.last_captured = max(p["last_captured"] for p in parts)
        # Ranks run the same model: they agree on the norm, or the site gets none.
        norms = {p["norm"] for p in parts if p["norm_traced"]}
        out.norm_traced = any(p["norm_traced"] for p in parts)
        out.norm = norms.pop() if len(norms) == 1 else None
        producers = {p.get("producer") for p in parts if p["norm_traced"]}
        out.producer = producers.pop() if len(producers) == 1 else None
        grad_producers = {p.get("grad_producer") for p in parts if p["norm_traced"]}
        out.grad_producer = grad_producers.pop() if len(grad_producers) == 1 else None
        # Re-verification starts where the latest rank started it.
        out.verify_from = max(p["verify_from"] for p in parts)
        drifted = [p for p in parts if p["drift_step"] is not None]
        if drifted:
            latest = max(drifted, key=lambda p: p["drift_step"])
            out.drift_step, out.drift_reason = latest["drift_step"], latest["drift_reason"]
        for key in sorted({k for p in parts for k in p["windows"]}):
            window = out.window(*key)
            for p in parts:
                if key in p["windows"]:
                    data, samples, first_step, last_step = p["windows"][key]
                    window.sketch.merge(Sketch.from_bytes(data))
                    window.samples += samples
                    window.step_first = (
                        first_step if window.step_first < 0 else min(window.step_first, first_step)
                    )
                    window.step_last = max(window.step_last, last_step)
        for attr in ("errors", "bf16"):
            keys = sorted({k for p in parts for k in p[attr]})
            merged = {
                k: ErrorSeries.merged([p[attr][k] for p in parts if k in p[attr]]) for k in keys
            }
            setattr(out, attr, merged)
        return out
