"""Step timers for `loka.dispatch.verify`: the time between consecutive step boundaries.

`start()` opens a block, `mark()` closes each step, `collect()` returns the block's step
times in seconds and is the only call that may wait for the device. On CUDA an event is
recorded on the current stream at each boundary: in steady state the time between two
events is the step's time whether the GPU or the host (launches) is the bottleneck, and
nothing synchronizes until the block ends.
"""

from __future__ import annotations

import itertools
import time
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StepTimer(Protocol):
    def start(self) -> None:
        """A block begins: the boundary before its first step."""

    def mark(self) -> None:
        """A step ended (after the optimizer step)."""

    def collect(self) -> list[float]:
        """The step times (seconds) since `start`, in order; the block is closed."""


class WallClockTimer:
    """Host clock at each boundary: right for a CPU model, whose work is done on return."""

    method = "wall clock"

    def __init__(self) -> None:
        self._marks: list[float] = []

    def start(self) -> None:
        self._marks = [time.perf_counter()]

    def mark(self) -> None:
        self._marks.append(time.perf_counter())

    def collect(self) -> list[float]:
        marks, self._marks = self._marks, []
        return [b - a for a, b in itertools.pairwise(marks)]


class CudaEventTimer:
    """A CUDA event per boundary on the current stream; one synchronization per block."""

    method = "CUDA events"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._events: list[torch.cuda.Event] = []
        self._pool: list[torch.cuda.Event] = []  # recorded events are reused, not re-created

    def start(self) -> None:
        self._pool += self._events
        self._events = []
        self.mark()

    def mark(self) -> None:
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._events.append(event)

    def collect(self) -> list[float]:
        events, self._events = self._events, []
        self._pool += events
        if len(events) < 2:
            return []
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]


def default_timer(device: torch.device | str) -> StepTimer:
    """CUDA events for a model on a GPU, the wall clock elsewhere."""
    device = torch.device(device)
    return CudaEventTimer(device) if device.type == "cuda" else WallClockTimer()
