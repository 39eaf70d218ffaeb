"""What every benchmark script shares: its arguments and time budget, one timing helper, the
error metric, the run's metadata and atomic result files.

    from harness import Budget, metadata, parser, rel_err, time_ms, write_json

    args = parser(__doc__, budget_s=300).parse_args(argv)   # --out, --budget-s
    budget = Budget(args.budget_s)
    ms = time_ms(fn, device)                                # median; CUDA: do_bench
    write_json(Path(args.out) / f"x_{stamp()}.json", {"meta": metadata(device), ...})

A script imports this module and does no work at import: it parses its arguments in
`main(argv)`, so tests can import it and call its pure parts. Importing this module loads
neither torch nor Triton (each helper imports what it needs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loka.schema import atomic_write

RESULTS = Path(__file__).resolve().parent / "results"


def default_out() -> str:
    """Where results go unless --out says: $OUT (the GPU runner's), else bench/results/."""
    return os.environ.get("OUT") or str(RESULTS)


def parser(description: str | None, *, budget_s: float | None = None) -> argparse.ArgumentParser:
    """An argument parser with the flags every script takes: --out and --budget-s (wall
    seconds; None: the script decides, e.g. by mode). `description`'s first line is used."""
    p = argparse.ArgumentParser(description=(description or "").strip().split("\n")[0])
    p.add_argument("--out", default=default_out(), help="folder of the result files")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help="wall-time budget in seconds; work past it is recorded as skipped")  # fmt: skip
    return p


class Budget:
    """A wall-time budget started at construction (`seconds` None or inf: unlimited)."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic):
        self.seconds = math.inf if seconds is None else float(seconds)
        self._clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self._clock() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def over(self, reserve: float = 0.0) -> bool:
        """True when less than `reserve` seconds are left."""
        return self.left() < reserve

    def share(self, fraction: float) -> float:
        """The deadline (in elapsed seconds) of a part given `fraction` of what is left."""
        return self.elapsed() + max(self.left(), 0.0) * fraction


def key_values(text: str) -> dict[str, Any]:
    """'every=50,rows=128,kind=row' -> {"every": 50, "rows": 128, "kind": "row"}: integers
    where a value reads as one, else the text."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        value = value.strip()
        out[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return out


def rel_err(out: Any, ref: Any) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|`` in float64 (0/0 is 0)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def time_ms(
    fn: Callable[[], object], device: Any = "cpu", *, reps: int = 5, rep_ms: int = 40
) -> float:
    """Median milliseconds of one call of `fn`, after one untimed call (compilation,
    autotuning). On CUDA: Triton's `do_bench` (`rep_ms` of calls, L2 flushed); elsewhere the
    median wall time of `reps` calls."""
    fn()
    if str(device).startswith("cuda"):
        import torch
        import triton

        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_events(step: Callable[[int], Any], steps: int) -> Any:
    """torch.profiler over `step(0)` .. `step(steps - 1)`, CPU and (where present) CUDA
    activity, the device synchronized before it stops: the `key_averages()` of the run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        if gpu:
            torch.cuda.synchronize()
    return prof.key_averages()


def device_kernels(events: Any) -> list:
    """The device-side kernel rows of `profile_events`' averages: not the CPU ops (whose
    self device time repeats their kernels') and not the GPU ranges of record_function
    labels (which span kernels already counted), the same rows torch's table totals."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation
            and e.self_device_time_total > 0]  # fmt: skip


def stamp(now: dt.datetime | None = None) -> str:
    """A UTC time stamp for result file names: 20261202T024500Z."""
    return (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")


def git_commit(cwd: Path | None = None) -> str | None:
    """The checkout's commit; in a tree exported without history (`scripts/device-carry`),
    the one its COMMIT file names; else None."""
    root = cwd or Path(__file__).parent
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                               cwd=root, timeout=10)  # fmt: skip
        commit = found.stdout.strip() if found.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if not _is_hash(commit):
        exported = Path(__file__).resolve().parents[1] / "COMMIT"
        commit = exported.read_text().strip() if exported.is_file() else ""
    return commit if _is_hash(commit) else None


def _is_hash(text: str) -> bool:
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)


def version(module: str) -> str | None:
    """`module.__version__`, or None where it is not installed."""
    try:
        return __import__(module).__version__
    except Exception:  # absent, or broken on this machine: recorded as None
        return None


def metadata(device: Any = "cpu", /, **extra: Any) -> dict[str, Any]:
    """What a result needs to be reproduced: the command, time, device, versions, commit and
    the environment switches of the kernels; `extra` (mode, budget, ...) is added last and
    may replace a field (e.g. a more telling `device`)."""
    import torch

    cuda = str(device).startswith("cuda") and torch.cuda.is_available()
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "torchao": version("torchao"),
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "autotune": os.environ.get("LOKA_KERNELS_AUTOTUNE", "1"),
        **extra,
    }


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (a reader sees the old file or the whole new one),
    creating the folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> Path:
    """`obj` as JSON (values JSON does not know written with `str`), atomically."""
    return write_atomic(path, json.dumps(obj, indent=indent, default=str))


def write_csv(path: str | os.PathLike, rows: list[dict], fields: list[str]) -> Path:
    """`rows` as CSV with columns `fields` (keys outside them left out), atomically."""
    import csv
    import io

    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return write_atomic(path, text.getvalue())


def load(script: str) -> Any:
    """Import `bench/<script>.py` as a module without running it, for its tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"bench_{script}", RESULTS.parent / f"{script}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
