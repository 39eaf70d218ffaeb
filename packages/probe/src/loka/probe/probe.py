"""`Probe`: attach to a model, mark steps, read the tables."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import traceback
import warnings
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl
import torch
from torch import nn

from loka.probe.analyze import Analyzer, StepJob
from loka.probe.capture import AmaxCapture, StepCapture
from loka.probe.config import ProbeConfig
from loka.probe.distributed import merged_states, world_size
from loka.probe.error_graphs import GraphCounts
from loka.probe.norms import NormTrace
from loka.probe.report import render_summary
from loka.probe.sites import SiteSpec, find_sites
from loka.probe.state import SiteState
from loka.probe.tables import build_tables
from loka.probe.worker import Worker
from loka.schema import TableWriteError, write_table

if TYPE_CHECKING:
    from rich.console import Console

TABLE_NAMES = ("sites", "tensor_stats", "site_errors")


class CompiledModelWarning(UserWarning):
    """Probe was attached to a torch.compile'd model (see `Probe`)."""


class Probe:
    """Online, sampled FP8 profiling of every GEMM site of `model`.

        probe = Probe(model, ProbeConfig())
        for batch in batches:
            loss = model(batch).mean(); loss.backward(); optimizer.step()
            probe.step()
        probe.save("probe/"); probe.summary(); probe.detach()

    Attaching adds hooks on sampled steps only and never changes what the model computes.
    `step()` marks the end of a training step. Statistics are computed on a background
    thread; `tables()`, `save()` and `summary()` wait for it. Under `torch.distributed`
    those three are collectives: every rank calls them and gets the same tables.
    """

    def __init__(self, model: nn.Module, config: ProbeConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Probe needs an nn.Module, got {type(model).__name__}")
        compiled = hasattr(model, "_orig_mod") or (
            getattr(model, "_compiled_call_impl", None) is not None
        )
        if compiled:
            # Dynamo keeps a module's hooks as they were at its first compiled call and does
            # not guard on them: compiled while Probe's hooks (graph breaks) are in place,
            # the model keeps a break at every site after detach().
            warnings.warn(
                "loka.probe: Probe on a torch.compile'd model: its next compile traces "
                "Probe's hooks as graph breaks, which stay after detach(); probe the "
                "uncompiled module (the wrapper's _orig_mod) and compile after, or use "
                "loka.dispatch.Session, which runs the compiled model eagerly while probing",
                CompiledModelWarning,
                stacklevel=2,
            )
        # torch.compile's wrapper: probe the module it compiles, so that site names are the
        # model's own (no "_orig_mod." prefix) and match a plan applied to either.
        model = getattr(model, "_orig_mod", model)
        self.config = config or ProbeConfig()
        specs = find_sites(model, self.config.excluded)
        if not specs:
            raise ValueError(
                f"{type(model).__name__} has no GEMM sites: no nn.Linear and no module with "
                "loka_gemm_operands(); make custom GEMM modules sites with "
                "loka.probe.register_site(cls, operands)"
                + (f" (excluded: {list(self.config.exclude)})" if self.config.exclude else "")
            )
        self.model = model
        self._specs: list[SiteSpec] = specs
        self._states: dict[str, SiteState] = {}
        for spec in specs:
            state = SiteState(spec.name, spec.kind)
            if isinstance(spec.module, nn.Linear) and spec.kind == "linear":
                state.K, state.N = spec.module.in_features, spec.module.out_features
            self._states[spec.name] = state
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()
        self._generators: dict[str, torch.Generator] = {}
        self._errors: list[str] = []
        self._needs_history = bool(self.config.history_lengths())
        self._history_len = max(self.config.history_lengths(), default=0)
        self._amax_history: dict[tuple[str, int, str], deque[tuple[int, torch.Tensor]]] = {}
        self._analyzer = Analyzer(self.config, self._states, self._lock)
        self._worker = Worker(self._analyzer.process, self.config.queue_size, self._record_error)
        self._step = 0
        self._sampled_steps = 0
        self._dropped_steps = 0
        self._dropped_samples = 0
        self._plans: dict[int, list[SiteSpec]] = {}
        self._planned_at: dict[str, int] = {}
        self._capture: StepCapture | None = None
        self._amax_capture: AmaxCapture | None = None
        self._norm_trace: NormTrace | None = None
        self._norms_traced = False  # the norms feeding the sites are found on one sampled step
        self._step_start: Any = None
        self._attached = True
        self._arm()

    # -- training-loop API -------------------------------------------------------------

    def step(self) -> None:
        """Mark the end of a training step (after the optimizer step)."""
        if not self._attached:
            raise RuntimeError("this Probe is detached; attach a new Probe to keep profiling")
        self._close_step()
        self._step += 1
        self._arm()

    def flush(self) -> None:
        """Wait until the background thread has processed every submitted step."""
        self._worker.flush()

    def detach(self) -> None:
        """Remove every hook and stop the background thread after it has finished its queue.
        The model is left exactly as it was; the tables stay available."""
        if not self._attached:
            return
        for capture in (self._capture, self._amax_capture, self._norm_trace):
            if capture is not None:
                capture.remove()
        self._capture = self._amax_capture = self._norm_trace = None
        self._amax_history.clear()
        self._worker.close()
        if self._analyzer.graphs is not None:
            self._analyzer.graphs.release()  # their inputs' copies and memory, not the counts
        self._attached = False

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- results -------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, Any]:
        """Progress and health: steps, sampled and dropped steps, background-thread time."""
        return {
            "step": self._step,
            "sampled_steps": self._sampled_steps,
            "dropped_steps": self._dropped_steps,
            "dropped_samples": self._dropped_samples,
            "errors": len(self._errors),
            "worker_busy_s": self._worker.busy_s,
            "worker_jobs": self._worker.jobs_done,
            "device_ms": self._analyzer.device_ms,
            **self._graph_counters(),
        }

    def _graph_counters(self) -> dict[str, int]:
        """The error analysis's CUDA graphs (`loka.probe.error_graphs`): analyses replayed,
        captured, evicted and run eagerly, and the bytes of the graphs' input copies."""
        graphs = self._analyzer.graphs
        counts = graphs.counts if graphs is not None else GraphCounts()
        return {
            "graph_replays": counts.replays,
            "graph_captures": counts.captures,
            "graph_evictions": counts.evictions,
            "graph_eager": counts.eager,
            "graph_input_bytes": graphs.input_bytes if graphs is not None else 0,
        }

    @property
    def errors(self) -> list[str]:
        """Messages of hooks or analyses that failed (training went on without them)."""
        return list(self._errors)

    def tables(self) -> dict[str, pl.DataFrame]:
        """The schema-validated `sites`, `tensor_stats` and `site_errors` tables."""
        self.flush()
        if self._errors:
            warnings.warn(
                f"loka.probe: {len(self._errors)} capture/analysis error(s), first: "
                f"{self._errors[0]}",
                RuntimeWarning,
                stacklevel=2,
            )
        with self._lock:
            states = merged_states(self._states)
        return build_tables(states, self.config)

    def save(self, directory: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the three tables as parquet into `directory` (created if missing).

        All or nothing: the three are written to a temporary folder beside the destination,
        then swapped in one by one with the old files set aside; if any swap fails, the
        swapped ones are put back, so the directory holds the old three or the new three.
        Raises `loka.schema.TableWriteError` naming the path and the cause when the place is
        not writable or a destination is in the way (a directory, say).
        """
        frames = self.tables()
        directory = Path(directory)
        targets = {name: directory / f"{name}.parquet" for name in TABLE_NAMES}
        in_the_way = [str(p) for p in targets.values() if p.is_dir()]
        if in_the_way:
            raise TableWriteError(
                f"cannot save probe tables to {directory}: {', '.join(in_the_way)} is a directory"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".loka-probe-", dir=directory))
        except OSError as exc:
            raise TableWriteError(
                f"cannot save probe tables to {directory}: {exc.strerror or exc}"
            ) from exc
        metadata = {
            "producer": "loka-probe",
            "step": str(self._step),
            "world_size": str(world_size()),
            "config": repr(self.config),
        }
        try:
            staged = {
                name: write_table(
                    frames[name], staging / f"{name}.parquet", name, metadata=metadata
                )
                for name in TABLE_NAMES
            }
            _swap_in(staged, targets, staging)
            return targets
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def summary(self, console: Console | None = None) -> str:
        """Print one line per site with its verdicts (rich) and return the text."""
        return render_summary(self.tables(), self.counters, console)

    # -- internals -----------------------------------------------------------------

    def _record_error(self, where: str, exc: BaseException) -> None:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self._errors.append(f"{where}: {detail}")

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            rank = torch.distributed.get_rank() if world_size() > 1 else 0
            g = torch.Generator(device=device)
            g.manual_seed(self.config.seed * 1_000_003 + rank)
            self._generators[key] = g
        return self._generators[key]

    def _on_amax(self, site: str, index: int, role: str, step: int, amax: torch.Tensor) -> None:
        if not self._needs_history:
            return
        key = (site, index, role)
        entries = self._amax_history.setdefault(key, deque(maxlen=self._history_len + 1))
        entries.append((step, amax))

    def _plan(self, step: int) -> list[SiteSpec]:
        """The sites captured on sampled step `step`: every undecided site, and each decided
        site on one sampled step in `decided_every`, staggered so the load is even."""
        if step in self._plans:
            return self._plans.pop(step)
        k = self._sampled_steps
        every = self.config.decided_every
        undecided, decided = [], []
        for i, spec in enumerate(self._specs):
            state = self._states[spec.name]
            if state.undecided:
                undecided.append(spec)
            elif (k + i) % every == 0:
                decided.append(spec)
        chosen = undecided + decided
        cap = self.config.max_sites_per_step
        if cap is not None:
            # Least recently planned first (a stable sort keeps module order on ties).
            undecided.sort(key=lambda s: self._planned_at.get(s.name, -1))
            decided.sort(key=lambda s: self._planned_at.get(s.name, -1))
            chosen = (undecided + decided)[:cap]
        for spec in chosen:
            self._planned_at[spec.name] = step
        return chosen

    def _record_norms(self, trace: NormTrace) -> None:
        trace.remove()
        if not trace.saw_a_forward:  # a step that ran no forward: trace the next one
            return
        fed, producers = trace.feeding_norms(), trace.input_producers()
        grad_producers = trace.output_grad_producers()
        with self._lock:
            for spec in self._specs:
                state = self._states[spec.name]
                state.norm, state.norm_traced = fed.get(spec.name), True
                state.producer = producers.get(spec.name)
                state.grad_producer = grad_producers.get(spec.name)
        self._norms_traced = True

    def _arm(self) -> None:
        step = self._step
        if self.config.is_sampled(step):
            plan = self._plan(step)
            self._capture = StepCapture(
                step,
                plan,
                rows=self.config.rows,
                generator=self._generator,
                timing=self.config.timing,
                on_error=self._record_error,
                on_amax=self._on_amax,
            )
            if not self._norms_traced:
                self._norm_trace = NormTrace(self.model, self._specs, on_error=self._record_error)
            if self.config.timing and self._device.type == "cuda":
                self._step_start = torch.cuda.Event(enable_timing=True)
                self._step_start.record()
        elif self._needs_history and self.config.is_sampled(step + 1):
            plan = self._plans[step + 1] = self._plan(step + 1)
            self._amax_capture = AmaxCapture(
                step, plan, on_error=self._record_error, on_amax=self._on_amax
            )

    def _close_step(self) -> None:
        if self._amax_capture is not None:
            self._amax_capture.remove()
            self._amax_capture = None
        if self._norm_trace is not None:
            self._record_norms(self._norm_trace)
            self._norm_trace = None
        capture = self._capture
        if capture is None:
            return
        capture.remove()
        self._capture = None
        self._sampled_steps += 1
        samples = [s for s in capture.samples.values() if s.calls]
        for sample in samples:
            for gemm in sample.gemms:
                gemm.history = {
                    role: [
                        (s, t)
                        for s, t in self._amax_history.get((sample.site, gemm.index, role), ())
                        if s < capture.step
                    ]
                    for role in ("input", "weight", "grad_output")
                }
        if not samples:
            return
        ready = None
        if self._device.type == "cuda":
            ready = torch.cuda.Event(enable_timing=self.config.timing)
            ready.record()
        job = StepJob(capture.step, self._device, samples, ready, self._step_start)
        self._step_start = None
        if not self._worker.submit(job, self.config.queue_wait_s):
            self._dropped_steps += 1
            self._dropped_samples += len(samples)


def _swap_in(staged: dict[str, Path], targets: dict[str, Path], staging: Path) -> None:
    """Move each staged file over its target, keeping the old ones in `staging` until all
    are in; on a failure, put everything back as it was and raise one TableWriteError."""
    done: list[tuple[str, Path | None]] = []  # (name, where its old file was set aside)
    name = ""
    try:
        for name, new in staged.items():
            target = targets[name]
            backup = staging / f"old-{name}.parquet" if target.exists() else None
            if backup is not None:
                os.replace(target, backup)
            done.append((name, backup))
            os.replace(new, target)
    except OSError as exc:
        _restore(done, targets)
        raise TableWriteError(
            f"cannot save probe tables: moving {name}.parquet into {targets[name].parent} "
            f"failed ({exc.strerror or exc}); the old tables were left in place"
        ) from exc


def _restore(done: list[tuple[str, Path | None]], targets: dict[str, Path]) -> None:
    for name, backup in reversed(done):
        target = targets[name]
        if backup is None:
            target.unlink(missing_ok=True)
        elif backup.exists():
            os.replace(backup, target)
