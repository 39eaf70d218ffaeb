"""CUDA graphs of a sampled GEMM's error sums: one replay instead of a thousand launches.

On a GPU host Probe's analysis is bound by host time per op, not by the device: one
sampled GEMM's error sums (every recipe of its three passes against the float64
reference) are about 1,200 aten ops, a sampled step of DHEN large 55,000
(`bench/probe_ops.py`), about 1 s of the background thread on an H100 and 2 s at DHEN xl
on the H200. The work repeats exactly whenever a site is sampled again: the same shapes,
recipes and flags, only new values. So the second time a layout comes, its work is
captured as a CUDA graph; from then on a sampled step copies the new samples into the
graph's input buffers and replays it.

- Key: the caller's static description (site, GEMM, what shapes the arithmetic: which
  histories exist, a token count no larger than the rows sampled; a larger one is an
  input, so jagged batches share a graph) and each input's shape, stride and dtype. A
  layout is captured the second time it is seen; a site keeps at most `MAX_PER_SITE`
  graphs, the least recently replayed dropped first, so layouts that never settle (rows
  sampled that change every batch) run eagerly as before, at no extra memory.
- Memory: each graph owns a copy of its inputs (the sampled rows and the site's weight
  snapshot: about one more copy of the weights of the sites analysed on the GPU,
  `ErrorGraphs.input_bytes`; at the xl presets 0.28 GB of weights for DHEN to 0.75 GB for
  HSTU), held until `Probe.detach()` releases them. Intermediates come from one memory pool that every graph
  shares: graphs replay one at a time on the analysis stream, and nothing reads a graph's
  intermediates after its replay, so the pool holds about the largest single analysis,
  not their sum.
- A graph's outputs live in that pool and the next replay of the same graph overwrites
  them: the caller copies them out on the same stream first (Probe copies them to pinned
  host memory at once).
- A capture that fails warns once and turns graphs off for this object: everything then
  runs eagerly, as it would without graphs.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ErrorGraphs", "GraphCounts"]

MAX_PER_SITE = 2  # graphs kept per site (the caller's first key element)
_SEEN = 256  # layouts remembered (seen once, not captured)

Inputs = Mapping[str, torch.Tensor | None]
# (replay, outputs): `replay()` recomputes `outputs` in place from the static inputs.
Capture = Callable[[Callable[[Inputs], Any], Inputs], tuple[Callable[[], None], Any]]


@dataclass
class GraphCounts:
    """What the graphs did: analyses replayed, captured, run eagerly."""

    replays: int = 0
    captures: int = 0
    evictions: int = 0
    eager: int = 0


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def cuda_capture(fn: Callable[[Inputs], Any], static: Inputs, pool: Any) -> tuple[Any, Any]:
    """(replay, outputs) of `fn(static)` captured on a side stream into `pool`."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = _SIDE_STREAMS.get(current.device)
    if side is None:
        side = _SIDE_STREAMS[current.device] = torch.cuda.Stream(current.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        # thread_local: the training thread's CUDA calls, which go on while Probe's
        # background thread captures, do not invalidate the capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = fn(static)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph.replay, outputs


class ErrorGraphs:
    """Graphs of pure functions of a few tensors, keyed by the caller and the inputs'
    layouts (see the module docstring).

    `run(key, inputs, fn)` returns ``fn(inputs)``: replayed from a graph when one was
    captured for `key` and these layouts, else run eagerly (and captured the second time
    the layout comes). `capture` replaces the CUDA capture (tests on the CPU)."""

    def __init__(self, capture: Capture | None = None, cuda_only: bool = True) -> None:
        self.counts = GraphCounts()
        self._capture = capture
        self._cuda_only = cuda_only
        self._pool: Any = None
        self._graphs: OrderedDict[tuple, tuple[Callable[[], None], Any, dict]] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._failed = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def input_bytes(self) -> int:
        """Bytes held by the graphs' copies of their inputs."""
        with self._lock:  # the background thread adds and drops graphs
            return sum(
                t.numel() * t.element_size()
                for _, _, static in self._graphs.values()
                for t in static.values()
                if t is not None
            )

    def release(self) -> None:
        """Drop every graph, its input copies and the shared pool (the counts stay)."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self._pool = None

    def usable(self, t: torch.Tensor) -> bool:
        """Whether work on `t` may be graphed at all."""
        if self._failed or (self._cuda_only and not t.is_cuda):
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())

    def run(self, key: tuple, inputs: Inputs, fn: Callable[[Inputs], Any]) -> Any:
        full = (key, *((name, _layout(t)) for name, t in sorted(inputs.items())))
        with self._lock:
            found = self._graphs.get(full)
            if found is not None:
                replay, outputs, static = found
                self._graphs.move_to_end(full)
                _copy_into(static, inputs)
                replay()
                self.counts.replays += 1
                return outputs
            if self._failed or full not in self._seen:
                self._seen[full] = None
                if len(self._seen) > _SEEN:
                    self._seen.popitem(last=False)
                self.counts.eager += 1
                return fn(inputs)
            return self._capture_and_replay(full, inputs, fn)

    def _capture_and_replay(self, full: tuple, inputs: Inputs, fn: Callable[[Inputs], Any]):
        static = {name: None if t is None else t.clone() for name, t in inputs.items()}
        try:
            if self._capture is not None:
                replay, outputs = self._capture(fn, static)
            else:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                replay, outputs = cuda_capture(fn, static, self._pool)
        except Exception as exc:  # any capture failure: everything runs eagerly from now on
            self._failed = True
            warnings.warn(
                f"loka.probe: the error analysis could not be captured as a CUDA graph "
                f"({type(exc).__name__}: {exc}); it runs eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
            self.counts.eager += 1
            return fn(inputs)
        site = full[0][0]
        held = [k for k in self._graphs if k[0][0] == site]
        if len(held) >= MAX_PER_SITE:
            del self._graphs[held[0]]  # least recently replayed: the dict is in LRU order
            self.counts.evictions += 1
        self._graphs[full] = (replay, outputs, static)
        self.counts.captures += 1
        replay()
        return outputs


def _layout(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _copy_into(static: Mapping[str, torch.Tensor | None], inputs: Inputs) -> None:
    for name, t in inputs.items():
        target = static[name]
        if target is not None:
            target.copy_(t)
