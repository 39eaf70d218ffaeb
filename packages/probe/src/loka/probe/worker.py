"""A background thread with a bounded queue: statistics never hold up the training step."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

_STOP = object()


class Worker:
    """Runs `process(job)` for submitted jobs on one daemon thread, in order.

    When `capacity` jobs are already waiting, `submit` waits up to `timeout` seconds for a
    slot (None: as long as needed; 0: not at all), then refuses the job (the caller counts
    the drop). An exception in `process` is passed to `on_error` and the
    thread goes on with the next job.
    """

    def __init__(
        self,
        process: Callable[[Any], None],
        capacity: int,
        on_error: Callable[[str, BaseException], None],
        name: str = "loka-probe",
    ) -> None:
        self._process = process
        self._on_error = on_error
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self.busy_s = 0.0
        self.jobs_done = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A daemon thread killed mid-operation at interpreter exit can abort the process
        # (seen with torch + gloo); stop it cleanly first if the user never detached.
        atexit.register(_close_at_exit, weakref.ref(self))

    def submit(self, job: Any, timeout: float | None = 0.0) -> bool:
        if not self._thread.is_alive():
            raise RuntimeError("the probe's background thread has stopped (probe detached)")
        try:
            if timeout == 0:
                self._queue.put_nowait(job)
            else:
                self._queue.put(job, timeout=timeout)
        except queue.Full:
            return False
        return True

    def flush(self) -> None:
        """Wait until every submitted job is processed."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Process what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                start = time.perf_counter()
                try:
                    self._process(job)
                except Exception as exc:  # statistics must never take training down
                    self._on_error("background thread", exc)
                self.busy_s += time.perf_counter() - start
                self.jobs_done += 1
            finally:
                self._queue.task_done()


def _close_at_exit(ref: weakref.ReferenceType[Worker]) -> None:
    worker = ref()
    if worker is not None:
        worker.close()
