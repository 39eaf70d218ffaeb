"""Turning one sampled step's captures into statistics (runs on the background thread).

Device phase, on a side stream that first waits for the training step's captures: the
per-recipe error GEMMs of large sites, row subsampling of the weights, and non-blocking
copies of everything the host needs into pinned memory. Host phase, once the copies have
landed: error GEMMs of small sites on the CPU, loka.stats sketches of the sampled
operands, per-batch errors, timings, drift checks and verdict flags.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from loka.probe.capture import GemmSample, SiteSample
from loka.probe.config import ProbeConfig
from loka.probe.error_graphs import ErrorGraphs
from loka.probe.gemm_error import PassOperands, pass_error_sums
from loka.probe.scaled_mm import has_fp8_gemm
from loka.probe.state import ErrorSeries, SiteState
from loka.schema import Recipe

# The fields of a GemmSample that its error sums read (the inputs of its CUDA graph).
_GRAPHED_FIELDS = ("x", "weight", "x_amax", "x_col_amax", "w_amax", "dy", "dy_amax", "dy_col_amax")


@dataclass
class StepJob:
    step: int
    device: torch.device
    samples: list[SiteSample]
    ready: Any = None  # CUDA event recorded on the training stream when the step ended
    step_start: Any = None  # CUDA event at the start of the step (timing)


def pass_operands(
    gemm: GemmSample, history: dict[int, dict[str, torch.Tensor]]
) -> dict[str, PassOperands]:
    """The operands of each pass that this sample can measure (all three with a gradient)."""

    def hist(a_role: str, b_role: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {
            h: (roles[a_role], roles[b_role])
            for h, roles in history.items()
            if a_role in roles and b_role in roles
        }

    out = {
        "fwd": PassOperands(
            gemm.x, gemm.weight, False, True, gemm.x_amax, gemm.w_amax,
            history=hist("input", "weight"), token_rows=True,
        )
    }  # fmt: skip
    if gemm.dy is not None:
        out["dgrad"] = PassOperands(
            gemm.dy, gemm.weight.T, False, True, gemm.dy_amax, gemm.w_amax,
            history=hist("grad_output", "weight"), token_rows=True,
            summed_total=gemm.m_total,
        )  # fmt: skip
        # wgrad reduces over all M rows: rowwise scales come from the full column amaxes.
        out["wgrad"] = PassOperands(
            gemm.dy.T, gemm.x.T, False, False, gemm.dy_amax, gemm.x_amax,
            a_row_amax=gemm.dy_col_amax, b_row_amax=gemm.x_col_amax,
            history=hist("grad_output", "input"), m_total=gemm.m_total,
        )  # fmt: skip
    return out


def history_maxima(
    gemm: GemmSample, step: int, lengths: set[int]
) -> dict[int, dict[str, torch.Tensor]]:
    """For each history length H: the largest amax per role over steps [step-H, step-1]."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for h in lengths:
        roles = {}
        for role, entries in gemm.history.items():
            kept = [t for s, t in entries if step - h <= s < step]
            if kept:
                roles[role] = torch.stack([t.to(gemm.x.device) for t in kept]).max()
        out[h] = roles
    return out


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _sample_to_host(gemm: GemmSample) -> GemmSample:
    moved = {
        name: _to_host(getattr(gemm, name))
        for name in ("x", "weight", "x_amax", "x_col_amax", "w_amax", "rows", "dy", "dy_amax", "dy_col_amax")
    }  # fmt: skip
    history = {
        role: [(s, _to_host(t)) for s, t in entries] for role, entries in gemm.history.items()
    }
    return replace(gemm, **moved, history=history)


def _numpy_rows(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A 2-D host tensor as numpy for loka.stats (bf16 as its bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy(), True
    if t.dtype in (torch.float16, torch.float32):
        return t.contiguous().numpy(), False
    return t.float().contiguous().numpy(), False


@dataclass
class _Pending:
    sample: SiteSample
    on_host: bool
    host_gemms: list[GemmSample] = field(default_factory=list)
    weight_rows: list[torch.Tensor] = field(default_factory=list)
    sums: dict[str, list[tuple[torch.Tensor, list[bool]]]] = field(default_factory=dict)
    amaxes: list[torch.Tensor] = field(default_factory=list)


class Analyzer:
    """Processes `StepJob`s into the `SiteState`s (guarded by `lock`)."""

    def __init__(
        self,
        config: ProbeConfig,
        states: dict[str, SiteState],
        lock: threading.Lock,
        graphs: ErrorGraphs | None = None,
    ) -> None:
        self.config = config
        # CUDA graphs of the error sums (`loka.probe.error_graphs`); `graphs` replaces them
        # (tests on the CPU).
        self.graphs = (
            graphs if graphs is not None else (ErrorGraphs() if config.error_graphs else None)
        )
        self.states = states
        self.lock = lock
        self.recipes: dict[str, list[Recipe]] = config.parsed_recipes()
        self.history_lengths = config.history_lengths()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.device_ms = 0.0  # device time of the error GEMMs (CUDA events, side stream)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.config.seed + 7919)
            self._generators[key] = g
        return self._generators[key]

    def _errors(
        self, site: str, gemm: GemmSample, step: int, real_fp8: bool
    ) -> dict[str, tuple[torch.Tensor, list[bool]]]:
        """Error sums and emulation flags of each pass of `gemm`: replayed from a CUDA graph
        when this site's layout was seen before (the sums are the graph's outputs, valid
        until its next replay: the caller copies them out on this stream)."""
        history = history_maxima(gemm, step, self.history_lengths)
        if self.graphs is None or not self.graphs.usable(gemm.x):
            return self._pass_sums(gemm, history, real_fp8)
        inputs = {name: getattr(gemm, name) for name in _GRAPHED_FIELDS}
        for h, roles in history.items():
            inputs.update({f"history.{h}.{role}": t for role, t in roles.items()})
        # More tokens than sampled (a batch's size may change from step to step, jagged
        # sequences): the count is an input, so one graph serves every batch.
        tokens: int | str = gemm.m_total
        if gemm.m_total > gemm.x.shape[0]:
            tokens = "more than sampled"
            inputs["m_total"] = torch.full(
                (), float(gemm.m_total), dtype=torch.float64, device=gemm.x.device
            )

        def compute(
            t: dict[str, torch.Tensor | None],
        ) -> dict[str, tuple[torch.Tensor, list[bool]]]:
            hist: dict[int, dict[str, torch.Tensor]] = {h: {} for h in history}
            for name, value in t.items():
                if name.startswith("history."):
                    _, h, role = name.split(".")
                    hist[int(h)][role] = value
            fields = {name: t[name] for name in _GRAPHED_FIELDS}
            if "m_total" in t:
                fields["m_total"] = t["m_total"]
            return self._pass_sums(replace(gemm, **fields), hist, real_fp8)

        return self.graphs.run((site, gemm.index, tokens, real_fp8), inputs, compute)

    def _pass_sums(
        self, gemm: GemmSample, history: dict[int, dict[str, torch.Tensor]], real_fp8: bool
    ) -> dict[str, tuple[torch.Tensor, list[bool]]]:
        out = {}
        for pass_, ops in pass_operands(gemm, history).items():
            if self.recipes[pass_]:
                out[pass_] = pass_error_sums(
                    ops, self.recipes[pass_], out_dtype=gemm.x.dtype, real_fp8=real_fp8
                )
        return out

    def _weight_rows(self, weight: torch.Tensor) -> torch.Tensor:
        n = weight.shape[0]
        if n <= self.config.rows:
            return weight
        g = self._generator(weight.device)
        rows = torch.randperm(n, generator=g, device=weight.device)[: self.config.rows]
        return weight.index_select(0, rows.sort().values)

    def process(self, job: StepJob) -> None:
        cuda = job.device.type == "cuda"
        pending: list[_Pending] = []
        if cuda:
            torch.cuda.set_device(job.device)
            if job.device not in self._streams:
                self._streams[job.device] = torch.cuda.Stream(job.device)
            stream = self._streams[job.device]
            stream.wait_event(job.ready)
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                pending = self._device_phase(
                    job, real_fp8=self.config.real_fp8 and has_fp8_gemm(job.device)
                )
                done = torch.cuda.Event(enable_timing=True)
                done.record()
            done.synchronize()
            self.device_ms += start.elapsed_time(done)
        else:
            pending = self._device_phase(job, real_fp8=False)
        step_ms = job.step_start.elapsed_time(job.ready) if cuda and job.step_start else None
        for item in pending:
            self._host_phase(job.step, item, step_ms)

    def _device_phase(self, job: StepJob, real_fp8: bool) -> list[_Pending]:
        pending = []
        for sample in job.samples:
            if not sample.gemms:
                pending.append(_Pending(sample, on_host=True))
                continue
            size = max(g.weight.shape[0] * g.weight.shape[1] for g in sample.gemms)
            on_host = job.device.type != "cuda" or size <= self.config.host_error_max_size
            item = _Pending(sample, on_host)
            for gemm in sample.gemms:
                amaxes = [
                    gemm.x_amax,
                    gemm.w_amax,
                    gemm.dy_amax if gemm.dy is not None else gemm.w_amax,
                ]
                item.amaxes.append(_to_host(torch.stack([a.float() for a in amaxes])))
                item.weight_rows.append(_to_host(self._weight_rows(gemm.weight)))
                if on_host:
                    item.host_gemms.append(_sample_to_host(gemm))
                else:
                    errors = self._errors(sample.site, gemm, job.step, real_fp8)
                    for pass_, (sums, emulated) in errors.items():
                        item.sums.setdefault(pass_, []).append((_to_host(sums), emulated))
                    item.host_gemms.append(
                        replace(gemm, x=_to_host(gemm.x), dy=_to_host(gemm.dy), weight=None)
                    )
            pending.append(item)
        return pending

    def _host_phase(self, step: int, item: _Pending, step_ms: float | None) -> None:
        sample = item.sample
        if item.on_host:
            for gemm in item.host_gemms:
                for pass_, result in self._errors(sample.site, gemm, step, False).items():
                    item.sums.setdefault(pass_, []).append(result)
        window_index = step // self.config.window_steps
        with self.lock:
            state = self.states[sample.site]
            self._record_site(state, sample, item, step_ms)
            if not item.host_gemms:
                return
            nonfinite = False
            for gemm, weight_rows, amaxes in zip(
                item.host_gemms, item.weight_rows, item.amaxes, strict=True
            ):
                nonfinite |= not bool(torch.isfinite(amaxes).all())
                for role, tensor in (
                    ("input", gemm.x),
                    ("weight", weight_rows),
                    ("grad_output", gemm.dy),
                ):
                    if tensor is None:
                        continue
                    window = state.window(role, window_index)
                    before = window.sketch.count - window.sketch.finite
                    values, bf16 = _numpy_rows(tensor)
                    window.sketch.update_rows(values, bf16=bf16)
                    nonfinite |= window.sketch.count - window.sketch.finite > before
                    window.add(step)
            if nonfinite:
                state.nonfinite_batches += 1
            else:
                self._record_errors(state, step, item)
            self._check_drift(state, window_index)
            state.refresh_undecided(self.config)

    def _record_site(
        self, state: SiteState, sample: SiteSample, item: _Pending, step_ms: float | None
    ) -> None:
        if sample.calls == 0:
            return
        state.calls += sample.calls
        state.m_seen += sample.m_seen
        state.captured_steps += 1
        state.last_captured = max(state.last_captured, sample.step)
        if sample.dtype:
            state.dtype, state.has_bias = sample.dtype, sample.has_bias
        if sample.shapes:
            state.groups = len(sample.shapes)
            state.K = max(k for k, _ in sample.shapes)
            state.N = max(n for _, n in sample.shapes)
        fwd, bwd, timed = 0.0, 0.0, step_ms is not None
        bwd_seen = True
        for t in sample.timings:
            if t.fwd_start is None or t.fwd_end is None:
                timed = False
                break
            fwd += t.fwd_start.elapsed_time(t.fwd_end)
            if t.bwd_start is not None and t.bwd_end is not None:
                bwd += t.bwd_start.elapsed_time(t.bwd_end)
            else:
                bwd_seen = False
        if timed and sample.timings:
            state.timings.append([fwd, bwd if bwd_seen else math.nan, float(sample.calls), step_ms])

    def _record_errors(self, state: SiteState, step: int, item: _Pending) -> None:
        for pass_, results in item.sums.items():
            total = sum(r[0].double().numpy() for r in results)
            emulated = [any(flags) for flags in zip(*(r[1] for r in results), strict=True)]
            if not np.isfinite(total[0]).all() or total[0][1] <= 0:
                continue  # an all-zero reference (e.g. zero gradient): nothing to measure
            state.bf16.setdefault(pass_, ErrorSeries()).add(step, total[0], False)
            for recipe, sums, emu in zip(self.recipes[pass_], total[1:], emulated, strict=True):
                if np.isfinite(sums).all():
                    state.errors.setdefault((str(recipe), pass_), ErrorSeries()).add(
                        step, sums, emu
                    )

    def _check_drift(self, state: SiteState, current: int) -> None:
        closed = sorted({w for (_, w) in state.windows if w < current})
        if len(closed) < 2 or closed[-1] <= state.drift_checked:
            return
        new, old = closed[-1], closed[-2]
        state.drift_checked = new
        tol = math.log(self.config.drift_tolerance)
        reasons = []
        for role in ("input", "weight", "grad_output"):
            a, b = state.windows.get((role, old)), state.windows.get((role, new))
            if a is None or b is None:
                continue
            for label, before, after in (
                ("p99.9", a.sketch.quantile(0.999), b.sketch.quantile(0.999)),
                ("amax", a.sketch.amax, b.sketch.amax),
            ):
                comparable = before > 0 and after > 0 and math.isfinite(before * after)
                if comparable and abs(math.log(after / before)) > tol:
                    reasons.append(f"{role} {label} {before:.3g} -> {after:.3g}")
        start = new * self.config.window_steps
        end = start + self.config.window_steps - 1
        for (recipe, pass_), series in state.errors.items():
            errs = np.asarray(series.balanced)
            recent = errs[series.mask(start, end)]
            earlier = errs[series.mask(state.verify_from, start - 1)]
            if recent.size >= 2 and earlier.size >= 2:
                before, after = float(earlier.mean()), float(recent.mean())
                if before > 0 and after > 0 and abs(math.log(after / before)) > tol:
                    reasons.append(f"{pass_} {recipe} error {before:.3g} -> {after:.3g}")
        if reasons:
            state.drift_step = start
            state.drift_reason = "; ".join(reasons)
            state.verify_from = start
