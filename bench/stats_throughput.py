"""Throughput of loka.stats on one CPU core, against numpy.quantile and datasketches KLL.

For float32 and bfloat16 inputs of 1e6, 1e7 and 1e8 values (normal activations), times:
- `Sketch.update` (the full sketch: counts, moments, histogram) and `update` + `quantiles`,
- `Sketch.update_rows` on [n / 1000, 1000] with 1x128 tiles (adds the row/block distributions),
- `numpy.quantile(abs(x), qs)` on the same values (bfloat16: on their float32 values),
- `datasketches.kll_floats_sketch(200)`: `update(abs(x))` then `get_quantiles(qs)`, if installed.
The process is pinned to one core with library threads set to 1. Speeds and ratios use the
median CPU time of the calling thread (wall time is recorded too): on a shared machine it
counts only the cycles each method got. Results (raw timings, medians, values per second,
ratios) and the machine record go to `--out`
(default `$OUT`, else `bench/results/`) as `stats_throughput_<host>_<time>.{json,csv}`.

    python bench/stats_throughput.py            # full run, about 2-3 minutes
    python bench/stats_throughput.py --smoke    # tiny sizes, a few seconds
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from harness import write_csv, write_json  # noqa: E402

from loka.stats import Sketch  # noqa: E402

QS = [0.5, 0.9, 0.99, 0.999, 0.9999]
ROW = 1000  # 1e6..1e8 divide evenly; tiles of 128 leave a partial one of 104
AIM_VALUES_PER_S = 500e6
AIM_VS_NUMPY = 20.0

try:
    from datasketches import kll_floats_sketch
except ImportError:  # optional: the comparison is skipped and says so
    kll_floats_sketch = None


def pin_to_one_core() -> int | None:
    """Pin to the last CPU allowed (Linux); elsewhere run unpinned and record None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    return cpu


def cpu_record() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "cpu MHz", "cache size"):
                info.setdefault(key, value.strip())
            if key == "flags":
                flags = set(value.split())
                info["simd"] = " ".join(
                    f for f in ("sse4_1", "avx2", "fma", "f16c", "avx512f") if f in flags
                )
                break
    except OSError:
        info["model name"] = platform.processor() or "unknown"
    return info


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(cpu: int | None) -> dict[str, object]:
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pinned_cpu": cpu,
        "cpu": cpu_record(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            d: version(d) for d in ("loka-stats", "numpy", "datasketches", "torch", "triton")
        },
    }


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


def measure(fn: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock and this thread's CPU seconds per run. Everything measured runs in the
    calling thread, so CPU time is what it costs even when other processes share the core."""
    fn()  # warm-up: page faults, thread-local scratch, caches
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return wall, cpu


def sketch_update(values: np.ndarray, bf16: bool) -> Callable[[], object]:
    return lambda: Sketch().update(values, bf16=bf16)


def sketch_update_quantiles(values: np.ndarray, bf16: bool) -> Callable[[], object]:
    def run() -> list[float]:
        s = Sketch()
        s.update(values, bf16=bf16)
        return s.quantiles(QS)

    return run


def sketch_update_rows(values: np.ndarray, bf16: bool) -> Callable[[], object]:
    rows = values.reshape(-1, ROW)
    return lambda: Sketch().update_rows(rows, block=128, bf16=bf16)


def numpy_quantile(values: np.ndarray) -> Callable[[], object]:
    return lambda: np.quantile(np.abs(values), QS)


def kll(values: np.ndarray) -> Callable[[], object]:
    def run() -> object:
        sketch = kll_floats_sketch(200)
        sketch.update(np.abs(values))
        return sketch.get_quantiles(QS)

    return run


def run_case(n: int, dtype: str, repeats: int, slow_repeats: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(3.0)
    if dtype == "bfloat16":
        bits = to_bf16_bits(x)
        del x
        sketched, bf16 = bits, True
        x = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        sketched, bf16 = x, False
    methods: list[tuple[str, Callable[[], object], int]] = [
        ("sketch.update", sketch_update(sketched, bf16), repeats),
        ("sketch.update+quantiles", sketch_update_quantiles(sketched, bf16), repeats),
        ("sketch.update_rows", sketch_update_rows(sketched, bf16), repeats),
        ("numpy.quantile", numpy_quantile(x), slow_repeats),
    ]
    if kll_floats_sketch is not None:
        methods.append(("datasketches.kll", kll(x), slow_repeats))
    out = []
    for name, fn, reps in methods:
        wall, cpu = measure(fn, reps)
        median, median_wall = statistics.median(cpu), statistics.median(wall)
        out.append(
            {
                "method": name,
                "dtype": dtype,
                "n": n,
                "cpu_seconds": cpu,
                "wall_seconds": wall,
                "median_s": median,
                "median_wall_s": median_wall,
                "values_per_s": n / median,
            }
        )
        print(
            f"  {dtype:8s} n={n:>11,d} {name:24s} {median * 1e3:10.2f} ms cpu "
            f"{median_wall * 1e3:10.2f} ms wall {n / median / 1e6:9.1f} M/s",
            flush=True,
        )
    return out


def ratios(results: list[dict[str, object]]) -> list[dict[str, object]]:
    by = {(r["dtype"], r["n"], r["method"]): r["median_s"] for r in results}
    rows = []
    for dtype, n in sorted({(r["dtype"], r["n"]) for r in results}):
        ours = by[(dtype, n, "sketch.update+quantiles")]
        row: dict[str, object] = {
            "dtype": dtype,
            "n": n,
            "update_M_per_s": n / by[(dtype, n, "sketch.update")] / 1e6,
            "update_rows_M_per_s": n / by[(dtype, n, "sketch.update_rows")] / 1e6,
            "x_numpy": by[(dtype, n, "numpy.quantile")] / ours,
            "x_kll": by.get((dtype, n, "datasketches.kll"), float("nan")) / ours,
        }
        row["meets_aims"] = bool(
            row["x_numpy"] >= AIM_VS_NUMPY
            and (dtype != "float32" or row["update_M_per_s"] * 1e6 >= AIM_VALUES_PER_S)
        )
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    )
    parser.add_argument("--sizes", type=float, nargs="+", help="override the sizes (values)")
    args = parser.parse_args()
    sizes = (
        [int(s) for s in args.sizes]
        if args.sizes
        else ([100_000] if args.smoke else [10**6, 10**7, 10**8])
    )
    if any(n % ROW for n in sizes):
        parser.error(f"sizes must be multiples of {ROW} (update_rows uses rows of {ROW})")
    cpu = pin_to_one_core()
    meta = metadata(cpu)
    meta["smoke"] = args.smoke
    meta["quantiles"] = QS
    meta["kll"] = "datasketches.kll_floats_sketch(k=200)" if kll_floats_sketch else "not installed"
    print(f"loka.stats throughput on CPU {cpu} ({meta['cpu'].get('model name', '?')})", flush=True)
    results = []
    for n in sizes:
        for dtype in ("float32", "bfloat16"):
            repeats = 1 if args.smoke else (5 if n <= 10**7 else 3)
            slow_repeats = 1 if (args.smoke or n >= 10**8) else 3
            results.extend(run_case(n, dtype, repeats, slow_repeats))
    summary = ratios(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out / f"stats_throughput_{socket.gethostname()}_{stamp}"
    write_json(
        stem.with_suffix(".json"), {"meta": meta, "results": results, "summary": summary}, indent=2
    )
    fields = ["method", "dtype", "n", "median_s", "median_wall_s", "values_per_s"]
    write_csv(stem.with_suffix(".csv"), results, fields)
    print()
    header = f"{'dtype':9s} {'n':>12s} {'update M/s':>11s} {'rows M/s':>9s} {'x numpy':>8s} {'x KLL':>7s}  aims"
    print(header)
    print("-" * len(header))
    for r in summary:
        print(
            f"{r['dtype']:9s} {r['n']:>12,d} {r['update_M_per_s']:>11.1f} {r['update_rows_M_per_s']:>9.1f} "
            f"{r['x_numpy']:>8.1f} {r['x_kll']:>7.1f}  {'met' if r['meets_aims'] else 'MISSED'}"
        )
    print(
        f"\n(medians of CPU time; x numpy / x KLL: their time over sketch.update+quantiles; aims: float32 update >= "
        f"{AIM_VALUES_PER_S / 1e6:.0f} M/s and >= {AIM_VS_NUMPY:.0f}x numpy)"
    )
    print(f"wrote {stem}.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
