"""CUDA graphs of an eager FP8 linear's quantizations: one graph launch per quantization
step instead of a Python call and a kernel launch per op.

An FP8 pass costs the host of an eager step far more than the bf16 GEMM it replaces: its
quantizations (amax, scale, cast, transpose; the history pushes of delayed scaling; the
weight's copies once per optimizer step) are a dozen ops and launches per call, where
nn.Linear's forward is one (`bench/host_profile.py`: all three passes in FP8 cost 6.8x
nn.Linear's host time on the H200's host). An eager recommendation model is often bound by
its host, so those passes lost the step (DHEN xl eager: 0.82x bf16 on a plan that its
kernel timings said would win). Compiled models do not need this: their quantization runs
inside inductor's graph.

What is graphed: the quantization of x (forward), of dY (backward) and of the weight (once
per optimizer step); pure functions of their input tensors. The GEMMs stay eager, so y, dx
and dW are fresh tensors as nn.Linear's are, and no caller ever holds graph memory.

A graph reads its inputs where they were when it was captured, so it is replayed only for
inputs at the same addresses, with the same shapes, strides and dtypes, on the same stream.
In a training loop the caching allocator hands out the same addresses step after step, so
nothing is copied into a graph. An input layout is captured the second time it is seen
(the one-off addresses of the first steps run eagerly), at most `max_graphs` per role and
module; past that a new layout that comes twice replaces the least recently replayed one,
`max_graphs` times per role, after which the role captures nothing new (its layouts do not
settle, and a capture costs more host time than a replay saves) until its graphs have been
replayed `SETTLED_REPLAYS` times since its last capture (a loop that settled after an
unsettled phase, an evaluation say, gets its graphs back).

Safety:
- each graph has its own memory pool: whatever order graphs replay in, one never writes
  into another's outputs;
- a graph's outputs are overwritten by its next replay, and two of them outlive the call
  that made them: x^T (saved for this module's backward) and the weight's FP8 copies (the
  module's cache). So a module replays its forward and weight graphs only while none of its
  backwards is pending (`hold` / `pending`); a module called twice before its backward (a
  shared layer, gradient accumulation over micro-batches with one backward) runs the second
  call eagerly. A backward run twice through a retained graph after the module ran forward
  again raises instead of reading overwritten data;
- a capture that fails (an op that cannot be captured) turns that role eager for the module,
  with one warning; inside someone else's capture (a model graphed whole) nothing is graphed.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["EagerGraphs", "GraphStats"]

MAX_GRAPHS = 2  # per role and module: past these the least recently replayed is dropped
# Roles whose outputs outlive the call (x^T saved for the backward, the weight cache).
SAVED_ROLES = frozenset({"input", "weight"})
_SEEN = 16  # layouts remembered (seen once, not captured) per module
SETTLED_REPLAYS = 64  # replays of a role after which it may capture again past its evictions


@dataclass
class GraphStats:
    """What a module's graphs did: calls replayed, captured, run eagerly (and why)."""

    replays: int = 0
    captures: int = 0
    evictions: int = 0  # graphs dropped for a newer layout (max_graphs per role)
    eager: Counter = field(default_factory=Counter)  # reason -> calls

    @property
    def eager_calls(self) -> int:
        return sum(self.eager.values())


class PendingBackward:
    """Held by the autograd context of each forward of a module with graphs, until its
    backward ran: while any is alive and not done, the module's forward and weight graphs
    stay idle (what that backward reads may be their outputs)."""

    __slots__ = ("__weakref__", "done", "generation")

    def __init__(self, generation: int) -> None:
        self.done = False
        self.generation = generation


def cuda_capture(fn: Callable[..., object], args: Sequence[object]) -> tuple[object, object]:
    """(graph, outputs) of `fn(*args)` captured on a side stream into a private memory pool.
    Nothing runs: replay the graph for this call's values."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = _side_stream(current.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        # thread_local: another thread's CUDA calls (a data loader's pinned copies) do not
        # invalidate this capture; the backward's captures run on autograd's device thread.
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = fn(*args)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph, outputs


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _layout(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class EagerGraphs:
    """The CUDA graphs of one module's quantization steps (see the module docstring).

    `run(role, fn, tensors, consts)` returns ``fn(*tensors, *consts)``: replayed from a graph
    when one was captured for these tensors' layouts, else run eagerly (and captured the
    second time a layout comes). `capture` replaces `cuda_capture` (tests on the CPU)."""

    def __init__(
        self,
        max_graphs: int = MAX_GRAPHS,
        capture: Callable[[Callable, Sequence], tuple[object, object]] | None = None,
        cuda_only: bool = True,
    ) -> None:
        self.max_graphs = max_graphs
        self.stats = GraphStats()
        self._capture = capture or cuda_capture
        self._cuda_only = cuda_only
        self._graphs: OrderedDict[tuple, tuple[object, object]] = OrderedDict()  # LRU last
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._evicted: Counter = Counter()
        self._replays_since_capture: Counter = Counter()
        self._failed: set[str] = set()
        self._pending: weakref.WeakSet[PendingBackward] = weakref.WeakSet()
        self._generation = 0  # bumped by every replay of a SAVED_ROLES graph
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._graphs)

    def __reduce__(self):
        # Graphs, their memory and pending tokens belong to this process and these tensors:
        # a copy (copy.deepcopy, pickling a model) starts with none.
        return (type(self), (self.max_graphs,))

    @property
    def pending(self) -> bool:
        """Whether a backward of this module is still to run over graph memory."""
        return any(not token.done for token in self._pending)

    def hold(self) -> PendingBackward:
        """A token for the autograd context of a forward whose backward is due."""
        token = PendingBackward(self._generation)
        self._pending.add(token)
        return token

    def check_current(self, token: PendingBackward | None) -> None:
        """Raise if the graph memory `token`'s forward saved was overwritten since (a
        backward through a retained graph after the module ran forward again)."""
        if token is None:
            return
        if token.done and token.generation != self._generation:
            raise RuntimeError(
                "Fp8Linear: backward through a retained graph after the module ran forward "
                "again; its saved FP8 input was a CUDA graph's output and is overwritten. "
                "Use Fp8LinearConfig(eager_graphs=False) for this model"
            )
        token.done = True

    def usable(self, t: torch.Tensor) -> bool:
        """Whether calls on `t` may be graphed at all (not inside another capture)."""
        if self._cuda_only and not t.is_cuda:
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())

    def run(
        self,
        role: str,
        fn: Callable[..., object],
        tensors: Sequence[torch.Tensor | None],
        consts: tuple = (),
    ):
        stream = torch.cuda.current_stream().cuda_stream if tensors[0].is_cuda else 0
        key = (role, consts, stream, *(_layout(t) for t in tensors))
        # nn.DataParallel's replicas share this object (a shallow copy of the module's
        # __dict__) and call it from one thread per GPU: the bookkeeping is locked.
        with self._lock:
            # A replay or capture would overwrite what a pending backward reads.
            blocked = role in SAVED_ROLES and self.pending
            found = None if blocked else self._graphs.get(key)
            if found is not None:
                graph, outputs = found
                self._graphs.move_to_end(key)
                graph.replay()
                self.stats.replays += 1
                self._replays_since_capture[role] += 1
                self._generation += role in SAVED_ROLES
                return outputs
            reason = "backward pending" if blocked else self._why_not(role, key)
            if reason is None:
                return self._capture_and_replay(role, key, fn, (*tensors, *consts))
            self.stats.eager[reason] += 1
        return fn(*tensors, *consts)

    def _capture_and_replay(self, role: str, key: tuple, fn: Callable, args: tuple):
        try:
            graph, outputs = self._capture(fn, args)
        except Exception as exc:  # any capture failure falls back to eager
            self._failed.add(role)
            warnings.warn(
                f"loka.mods: the {role} quantization of an Fp8Linear could not be captured as "
                f"a CUDA graph ({type(exc).__name__}: {exc}); it runs eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            self.stats.eager["capture failed"] += 1
            return fn(*args)
        if self._held(role) >= self.max_graphs:
            self._evicted[role] += 1
            oldest = next(k for k in self._graphs if k[0] == role)
            del self._graphs[oldest]  # its memory goes once no saved tensor holds it
            self.stats.evictions += 1
        self._graphs[key] = (graph, outputs)
        self.stats.captures += 1
        self._replays_since_capture[role] = 0
        graph.replay()
        self._generation += role in SAVED_ROLES
        return outputs

    def _held(self, role: str) -> int:
        return sum(k[0] == role for k in self._graphs)

    def _why_not(self, role: str, key: tuple) -> str | None:
        """Why a layout without a graph runs eagerly now (None: capture it)."""
        if role in self._failed:
            return "capture failed"
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > _SEEN:
                self._seen.popitem(last=False)
            return "first sight"
        if self._held(role) >= self.max_graphs and self._evicted[role] >= self.max_graphs:
            if self._replays_since_capture[role] < SETTLED_REPLAYS:
                return "layouts unsettled"
            self._evicted[role] = 0
        return None
