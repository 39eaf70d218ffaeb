"""Hooks that capture a site's operands on a sampled step, and amaxes on the step before.

Everything here runs on the training thread, inside the model's forward and backward, so
it only enqueues small device work (row gathers, amax reductions, a weight snapshot, CUDA
events) and never reads a value back: the training step does not wait on statistics.
Rows are drawn with Probe's own generator (the model's RNG stream is untouched) and the
same rows are taken from the input and the output gradient, so wgrad pairs match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loka.probe.sites import GemmCall, SiteSpec, read_calls


@dataclass
class GemmSample:
    """One GEMM of one site on one sampled step, on the device."""

    x: torch.Tensor  # [m, K] sampled rows, compute dtype
    weight: torch.Tensor  # [N, K] snapshot, compute dtype
    x_amax: torch.Tensor  # amax of the full input
    x_col_amax: torch.Tensor  # [K] amax of every input channel over all rows
    w_amax: torch.Tensor
    m_total: int
    rows: torch.Tensor | None  # indices of the sampled rows (None: all)
    index: int = 0  # which GEMM of the site's call
    dy: torch.Tensor | None = None  # [m, N] same rows of the output gradient
    dy_amax: torch.Tensor | None = None
    dy_col_amax: torch.Tensor | None = None
    # role -> amaxes of that operand on earlier steps (delayed scaling), filled on submit
    history: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)


@dataclass
class CallTiming:
    fwd_start: Any
    fwd_end: Any = None
    bwd_start: Any = None
    bwd_end: Any = None


@dataclass
class SiteSample:
    site: str
    step: int
    gemms: list[GemmSample] = field(default_factory=list)
    timings: list[CallTiming] = field(default_factory=list)
    calls: int = 0
    m_seen: list[int] = field(default_factory=list)
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (K, N) of every GEMM
    dtype: str = ""
    has_bias: bool = False
    missing_grad: int = 0


def _amaxes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax of `t [M, C]`, amax of each column), in float32; NaN propagates."""
    lo, hi = torch.aminmax(t, dim=0)
    cols = torch.maximum(lo.neg(), hi).float()
    return cols.max(), cols


def _amax(t: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.neg(), hi).float()


def _compute_dtype(call: GemmCall) -> torch.dtype:
    return call.output.dtype if call.output.is_floating_point() else call.x.dtype


class Recorder:
    """Hook callbacks shared by capture and amax-tracking steps, plus error bookkeeping:
    a failing hook is counted and reported, never raised into the training step."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self.on_error = on_error
        self.handles: list[Any] = []
        self.closed = False

    def guard(
        self, where: str, fn: Callable[..., Any], *, forward: bool = False
    ) -> Callable[..., Any]:
        """`fn` as a hook that never raises into training. `forward`: a module's forward
        hook, skipped inside a backward, where only activation checkpointing's rerun of
        the forward calls it (its operands were read on the first run; read again they
        doubled the site's calls and added gradient hooks on tensors no backward reaches)."""

        # None of the ops used here is autocast-eligible, so autocast needs no handling.
        def wrapped(*args: Any) -> None:
            if self.closed:  # e.g. a backward that runs after Probe.step() closed the step
                return
            if forward and torch._C._current_graph_task_id() != -1:
                return
            try:
                with torch.no_grad():
                    fn(*args)
            except Exception as exc:  # a statistics failure must never stop training
                self.on_error(where, exc)

        # Under torch.compile a hook runs eagerly (a graph break): traced, its Python-side
        # bookkeeping would be compiled into the model's graph and recompiled as it changes.
        return torch.compiler.disable(wrapped)

    def remove(self) -> None:
        self.closed = True
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class StepCapture(Recorder):
    """Captures the selected sites' operands during one sampled step."""

    def __init__(
        self,
        step: int,
        sites: list[SiteSpec],
        *,
        rows: int,
        generator: Callable[[torch.device], torch.Generator],
        timing: bool,
        on_error: Callable[[str, BaseException], None],
        on_amax: Callable[[str, int, str, int, torch.Tensor], None],
    ) -> None:
        super().__init__(on_error)
        self.step = step
        self.rows = rows
        self.generator = generator
        self.timing = timing
        self.on_amax = on_amax
        self.samples = {spec.name: SiteSample(spec.name, step) for spec in sites}
        for spec in sites:
            module = spec.module
            self.handles.append(
                module.register_forward_pre_hook(
                    self.guard(spec.name, self._pre(spec), forward=True)
                )
            )
            # First among the post-forward hooks: FSDP2's own (on a module fully_shard was
            # called on) puts the weight's shards back, and the operands are read here.
            self.handles.append(
                module.register_forward_hook(
                    self.guard(spec.name, self._post(spec), forward=True), prepend=True
                )
            )

    def _event(self, device: torch.device) -> Any:
        if not self.timing or device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _pre(self, spec: SiteSpec) -> Callable[..., None]:
        sample = self.samples[spec.name]

        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            if device is None:
                device = next(module.parameters()).device
            sample.timings.append(CallTiming(self._event(device)))

        return pre

    def _post(self, spec: SiteSpec) -> Callable[..., None]:
        sample = self.samples[spec.name]

        def post(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            timing = sample.timings[-1] if sample.timings else CallTiming(None)
            calls = read_calls(spec, args, output)
            if not calls:
                return
            timing.fwd_end = self._event(calls[0].x.device)
            first_call = sample.calls == 0
            sample.calls += 1
            sample.m_seen.append(max(c.x.shape[0] for c in calls))
            gemms: list[GemmSample | None] = [None] * len(calls)
            if first_call:
                sample.dtype = str(_compute_dtype(calls[0])).removeprefix("torch.")
                sample.has_bias = calls[0].has_bias
                sample.shapes = [(c.weight.shape[1], c.weight.shape[0]) for c in calls]
                gemms = [self._capture(sample, i, c) for i, c in enumerate(calls)]
            self._hook_backward(spec, sample, calls, gemms, timing)

        return post

    def _capture(self, sample: SiteSample, index: int, call: GemmCall) -> GemmSample | None:
        dtype = _compute_dtype(call)
        x = call.x.detach()
        m_total = x.shape[0]
        if m_total == 0:
            return None
        rows = None
        if m_total > self.rows:
            g = self.generator(x.device)
            rows = torch.randperm(m_total, generator=g, device=x.device)[: self.rows].sort().values
        x_amax, x_cols = _amaxes(x)
        # The GEMM sees x in its compute dtype; rounding is monotone, so amaxes round alike.
        x_amax, x_cols = x_amax.to(dtype).float(), x_cols.to(dtype).float()
        weight = call.weight.detach().to(dtype, copy=True)
        gemm = GemmSample(
            x=(x.index_select(0, rows) if rows is not None else x).to(dtype, copy=True),
            weight=weight,
            x_amax=x_amax,
            x_col_amax=x_cols,
            w_amax=_amax(weight),
            m_total=m_total,
            rows=rows,
            index=index,
        )
        sample.gemms.append(gemm)
        self.on_amax(sample.site, index, "input", self.step, x_amax)
        self.on_amax(sample.site, index, "weight", self.step, gemm.w_amax)
        return gemm

    def _hook_backward(
        self,
        spec: SiteSpec,
        sample: SiteSample,
        calls: list[GemmCall],
        gemms: list[GemmSample | None],
        timing: CallTiming,
    ) -> None:
        for index, (call, gemm) in enumerate(zip(calls, gemms, strict=True)):
            if not call.output.requires_grad:
                continue

            def on_grad(grad: torch.Tensor, call=call, gemm=gemm, index=index) -> None:
                if gemm is not None:
                    dy = call.grad(grad) if call.grad is not None else grad
                    dy = dy.detach().reshape(-1, call.weight.shape[0])
                    if dy.shape[0] != gemm.m_total:
                        sample.missing_grad += 1
                    else:
                        dtype = gemm.x.dtype
                        gemm.dy_amax, gemm.dy_col_amax = _amaxes(dy)
                        picked = dy.index_select(0, gemm.rows) if gemm.rows is not None else dy
                        gemm.dy = picked.to(dtype, copy=True)
                        self.on_amax(sample.site, index, "grad_output", self.step, gemm.dy_amax)
                if index == 0 and timing.bwd_start is None:
                    timing.bwd_start = self._event(grad.device)

            self.handles.append(call.output.register_hook(self.guard(spec.name, on_grad)))
        # The end of this site's backward: the weight's (else the input's) gradient exists.
        first = calls[0]
        end = first.weight if first.weight.requires_grad else first.input
        if end.requires_grad and timing.fwd_start is not None:

            def on_end(grad: torch.Tensor) -> None:
                timing.bwd_end = self._event(grad.device)

            self.handles.append(end.register_hook(self.guard(spec.name, on_end)))


class AmaxCapture(Recorder):
    """On the step before a sampled step: only the amaxes that delayed scaling needs."""

    def __init__(
        self,
        step: int,
        sites: list[SiteSpec],
        *,
        on_error: Callable[[str, BaseException], None],
        on_amax: Callable[[str, int, str, int, torch.Tensor], None],
    ) -> None:
        super().__init__(on_error)
        self.step = step
        self.on_amax = on_amax
        self.seen: set[str] = set()
        for spec in sites:
            self.handles.append(
                spec.module.register_forward_hook(
                    self.guard(spec.name, self._post(spec), forward=True), prepend=True
                )
            )

    def _post(self, spec: SiteSpec) -> Callable[..., None]:
        def post(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if spec.name in self.seen:
                return
            self.seen.add(spec.name)
            for index, call in enumerate(read_calls(spec, args, output)):
                if call.x.shape[0] == 0:
                    continue
                dtype = _compute_dtype(call)
                x_amax = _amax(call.x.detach()).to(dtype).float()
                w_amax = _amax(call.weight.detach()).to(dtype).float()
                self.on_amax(spec.name, index, "input", self.step, x_amax)
                self.on_amax(spec.name, index, "weight", self.step, w_amax)
                if call.output.requires_grad:

                    def on_grad(grad: torch.Tensor, call=call, index=index) -> None:
                        dy = call.grad(grad) if call.grad is not None else grad
                        self.on_amax(spec.name, index, "grad_output", self.step, _amax(dy.detach()))

                    self.handles.append(call.output.register_hook(self.guard(spec.name, on_grad)))

        return post
