"""The zoo's large presets on one GPU: the bf16 training-step baselines that every LoKA
speedup is compared against.

For each model (DLRM, DHEN, Wukong, HSTU; SASRec on request), synthetic data generated on
the GPU, AdamW, bf16 autocast, `loka.zoo.training_step` (the same step `loka.zoo.train`
runs):
- step:    median step time (CUDA events) over --steps steps after --warmup, cycling a pool
           of pre-generated batches, so data generation is excluded; eager, then compiled
           (`torch.compile` of the model) for the models in --compile while budget is left;
- e2e:     the same step with a fresh batch generated every step, as `train()` runs it;
- gen:     median time to generate one batch, and its share of the e2e step;
- profile: torch.profiler over --profile-steps steps: CUDA time per kernel class (gemm,
           attention, embedding, optimizer, other) and per GEMM shape (M, K, N: calls, ms
           per step, TFLOP/s); the GEMM share g bounds what FP8 GEMMs alone can give:
           1 / ((1 - g) + g / s);
- memory:  peak allocated bytes over the timed steps.
The anchor (/work/shared/anchors/README.md): the DHEN-style model compiled, bf16, batch
16384, 30.3-32.6 ms per step on an H200; the DHEN rows report their ratio to it.

    python bench/zoo_baseline.py --smoke   # CPU, tiny presets, well under a minute
    python bench/zoo_baseline.py           # GPU, large presets, about 4 minutes
    python bench/zoo_baseline.py --beauty 1200   # SASRec on Amazon Beauty vs popularity
Results: zoo_baseline_<mode>_<utc time>.json (metadata, every measurement, GEMM shapes) and
.csv (one row per model and mode) in --out (default $OUT, else bench/results/); --beauty
writes zoo_sasrec_beauty_<device>_<utc time>.json (needs the Amazon data, see loka.zoo).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from harness import git_commit, write_csv, write_json

import loka.zoo as zoo

ANCHOR_DHEN_COMPILED_MS = (30.3, 32.6)  # bf16 seeds 0/1/2, /work/shared/anchors/README.md
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
# Kernel classes by name. Inductor's fused pointwise kernels may carry "mm" in their names
# (an addmm's epilogue), so among Triton kernels only templates ("triton_tem_") are GEMMs.
KERNEL_CLASSES = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|wgmma|^triton_tem_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("embedding", re.compile(r"embedding|embbag|indexselect|index_select", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|foreach", re.I)),
)
OP_CLASSES = (
    ("attention", ("attention", "flash", "sdpa")),
    ("embedding", ("embedding",)),
    ("optimizer", ("adam", "_foreach")),
)
CSV_FIELDS = [
    "model", "mode", "preset", "batch", "tokens", "step_ms", "step_p10_ms", "step_p90_ms",
    "e2e_ms", "gen_ms", "gen_share_of_e2e", "gemm_share", "attention_share",
    "embedding_share", "optimizer_share", "other_share", "peak_gb", "params_m",
    "dense_params_m", "linears", "fp8_ceiling_s1.5", "fp8_ceiling_s1.9", "vs_anchor", "error",
]  # fmt: skip
# Pre-quantized FP8 GEMM speedups over bf16 measured in the anchors (1.5x-1.9x at K, N >=
# 2048; less below): the end-to-end ceiling if every GEMM got s is 1 / ((1 - g) + g / s).
CEILING_SPEEDUPS = (1.5, 1.9)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny presets; runs on CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    p.add_argument("--models", default="dlrm,dhen,wukong,hstu", help="comma list; add sasrec")
    p.add_argument(
        "--compile",
        default=None,
        help="models also timed under torch.compile, in this order, while budget is "
        "left ('' for none; default dhen,dlrm,wukong, none with --smoke)",
    )
    p.add_argument("--preset", default=None, help="default: large (tiny with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (50; 3 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (10; 1 smoke)")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps (5; 1 smoke)")
    p.add_argument("--fresh-steps", type=int, default=None, help="e2e steps (20; 2 smoke)")
    p.add_argument("--gen-batches", type=int, default=None, help="timed generations (20; 2)")
    p.add_argument("--pool", type=int, default=8, help="distinct pre-generated batches cycled")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall budget; compiled runs start only while this much is left over "
        "--compile-cost-s (default 240, 60 smoke)",
    )
    p.add_argument(
        "--beauty",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: train SASRec on Amazon Beauty for STEPS steps and compare "
        "HR@10/NDCG@10/MRR with the popularity baseline",
    )
    p.add_argument(
        "--compile-cost-s",
        type=float,
        default=75.0,
        help="expected time of one compiled run, to stay within the budget",
    )
    args = p.parse_args()
    smoke = args.smoke
    defaults = {
        "preset": "tiny" if smoke else "large",
        "steps": 3 if smoke else 50,
        "warmup": 1 if smoke else 10,
        "profile_steps": 1 if smoke else 5,
        "fresh_steps": 2 if smoke else 20,
        "gen_batches": 2 if smoke else 20,
        "budget_s": 60.0 if smoke else 240.0,
        "compile": "" if smoke else "dhen,dlrm,wukong",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


class Timer:
    """Per-interval times in ms: CUDA events on the GPU (no sync inside the loop), the host
    clock after a sync otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_steps(
    step: Callable[[dict], object], batches: Callable[[int], dict], n: int, device: torch.device
) -> list[float]:
    timer = Timer(device)
    timer.mark()
    for i in range(n):
        step(batches(i))
        timer.mark()
    return timer.intervals()


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def op_class(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    for label, words in OP_CLASSES:
        if any(word in name for word in words):
            return label
    return "other"


def _device_time_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _gemm_shape(name: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) from a GEMM op's recorded input shapes."""
    dims = [s for s in shapes if isinstance(s, list) and len(s) >= 2]
    if name in ("aten::bmm", "aten::baddbmm"):
        dims = [s for s in dims if len(s) == 3]
        if len(dims) >= 2:
            return dims[-2][0], dims[-2][1], dims[-2][2], dims[-1][2]
        return None
    dims = [s for s in dims if len(s) == 2]
    if len(dims) >= 2:  # addmm: (bias, x, w^T); mm and _scaled_mm: (x, w^T)
        x, w = dims[-2], dims[-1]
        return 1, x[0], x[1], w[1]
    return None


def profile(
    step: Callable[[dict], object], batches: Callable[[int], dict], n: int, device: torch.device
) -> dict:
    """Device time per kernel class and per GEMM shape, per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for i in range(n):
            step(batches(i))
        sync(device)
    kernels: dict[str, float] = {}  # by kernel name (device events)
    ops: dict[str, float] = {}  # by the aten op that launched the time (self time)
    top_kernels: dict[str, float] = {}
    on_gpu = device.type == "cuda"
    for event in prof.key_averages():
        if on_gpu and getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            us = _device_time_us(event)
            kernels[kernel_class(event.key)] = kernels.get(kernel_class(event.key), 0.0) + us
            top_kernels[event.key] = top_kernels.get(event.key, 0.0) + us
        elif event.key.startswith("aten::"):
            us = _device_time_us(event) if on_gpu else float(event.self_cpu_time_total)
            ops[op_class(event.key)] = ops.get(op_class(event.key), 0.0) + us
    # Kernel names are the ground truth on the GPU; the op view is the fallback and a check.
    classes, method = (kernels, "cuda kernels by name") if kernels else (ops, "aten ops")
    total = sum(classes.values()) or 1.0
    ops_total = sum(ops.values()) or 1.0
    shapes: dict[tuple, dict] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in GEMM_OPS:
            continue
        shape = _gemm_shape(event.key, list(getattr(event, "input_shapes", []) or []))
        if shape is None:
            continue
        us = _device_time_us(event) if device.type == "cuda" else float(event.self_cpu_time_total)
        row = shapes.setdefault((event.key, *shape), {"calls": 0, "us": 0.0})
        row["calls"] += event.count
        row["us"] += us
    gemm_rows = []
    for (op, batch, m, k, n_), row in sorted(shapes.items(), key=lambda kv: -kv[1]["us"]):
        flops = 2.0 * batch * m * k * n_ * row["calls"]
        gemm_rows.append(
            {
                "op": op,
                "batch": batch,
                "M": m,
                "K": k,
                "N": n_,
                "calls_per_step": row["calls"] / n,
                "ms_per_step": row["us"] / 1e3 / n,
                "tflops": flops / (row["us"] * 1e-6) / 1e12 if row["us"] > 0 else None,
            }
        )
    return {
        "method": method,
        "ms_per_step": {k: v / 1e3 / n for k, v in sorted(classes.items())},
        "share": {k: v / total for k, v in sorted(classes.items())},
        "op_share": {k: v / ops_total for k, v in sorted(ops.items())},
        "gemm_shapes": gemm_rows[:40],
        "top_kernels": [
            {"name": name[:160], "ms_per_step": us / 1e3 / n, "class": kernel_class(name)}
            for name, us in sorted(top_kernels.items(), key=lambda kv: -kv[1])[:25]
        ],
    }


def describe(setup: zoo.ZooSetup) -> dict:
    params = list(setup.model.named_parameters())
    embedding = sum(p.numel() for name, p in params if "embed" in name)
    total = sum(p.numel() for _, p in params)
    config = setup.config
    tokens = setup.batch_size * getattr(config, "max_seq_len", 1)
    return {
        "batch": setup.batch_size,
        "tokens": tokens,
        "params_m": total / 1e6,
        "dense_params_m": (total - embedding) / 1e6,
        "linears": sum(isinstance(m, torch.nn.Linear) for m in setup.model.modules()),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(config).items()},
        "data_config": {k: v for k, v in vars(setup.data_config).items() if k != "cardinalities"},
    }


def run_model(name: str, args: argparse.Namespace, device: torch.device, compiled: bool) -> dict:
    """Every measurement of one model in one mode; raises on failure (caught by the caller)."""
    setup = zoo.create(name, args.preset, device=device, seed=0)
    record: dict = {
        "model": name,
        "mode": "compiled" if compiled else "eager",
        "preset": args.preset,
        **describe(setup),
    }
    model = torch.compile(setup.model) if compiled else setup.model
    optimizer = torch.optim.AdamW(setup.model.parameters(), lr=1e-3)

    def step(batch: dict) -> torch.Tensor:
        return zoo.training_step(
            setup, model, optimizer, batch, autocast_dtype=torch.bfloat16, check_finite=False
        )

    data = setup.data
    started = time.perf_counter()
    pool = [data.batch(i) for i in range(args.pool)]
    sync(device)
    record["pool_build_s"] = time.perf_counter() - started

    def from_pool(i: int) -> dict:
        return pool[i % len(pool)]

    started = time.perf_counter()
    warm = timed_steps(step, from_pool, max(args.warmup, args.pool if compiled else 0), device)
    record["warmup_s"] = time.perf_counter() - started
    record["warmup_ms"] = warm
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed_steps(step, from_pool, args.steps, device)
    record.update(
        step_ms=statistics.median(times),
        step_p10_ms=quantile(times, 0.1),
        step_p90_ms=quantile(times, 0.9),
        step_times_ms=times,
    )
    if device.type == "cuda":
        record["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9

    # Fresh data every step, as train() runs: generation + step.
    fresh = setup.train_batches()
    e2e = timed_steps(step, lambda _: next(fresh), args.fresh_steps, device)
    record["e2e_ms"] = statistics.median(e2e)
    gen_index = iter(range(10_000, 10_000 + args.gen_batches + 1))
    gen = timed_steps(
        lambda batch: batch, lambda _: data.batch(next(gen_index)), args.gen_batches, device
    )
    record["gen_ms"] = statistics.median(gen)
    record["gen_share_of_e2e"] = record["gen_ms"] / record["e2e_ms"]

    losses = [float(step(from_pool(i))) for i in range(2)]
    record["loss_after"] = losses[-1]
    try:
        record["profile"] = profile(step, from_pool, args.profile_steps, device)
    except Exception as error:  # the profile is secondary: keep the timings
        record["profile_error"] = f"{type(error).__name__}: {error}"
    return record


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    out["cuda"] = torch.version.cuda
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def csv_row(record: dict) -> dict:
    share = record.get("profile", {}).get("share", {})
    row = {key: record.get(key, "") for key in CSV_FIELDS}
    for label in ("gemm", "attention", "embedding", "optimizer", "other"):
        row[f"{label}_share"] = share.get(label, "") if share else ""
    gemm = share.get("gemm") if share else None
    for speedup in CEILING_SPEEDUPS:
        row[f"fp8_ceiling_s{speedup}"] = 1 / ((1 - gemm) + gemm / speedup) if gemm else ""
    if record.get("model") == "dhen" and record.get("step_ms"):
        row["vs_anchor"] = (sum(ANCHOR_DHEN_COMPILED_MS) / 2) / record["step_ms"]
    return row


def write(records: list[dict], meta: dict, out: Path, mode: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    base = out / f"zoo_baseline_{mode}_{stamp}"
    json_path, csv_path = base.with_suffix(".json"), base.with_suffix(".csv")
    write_json(json_path, {"meta": meta, "runs": records})
    write_csv(csv_path, [csv_row(r) for r in records], CSV_FIELDS)
    return json_path, csv_path


def fmt(value: object, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "-" if value in (None, "") else str(value)


def print_summary(records: list[dict]) -> None:
    header = (
        f"{'model':8} {'mode':9} {'batch':>6} {'step ms':>8} {'e2e ms':>8} {'gen ms':>7} "
        f"{'gen%':>5} {'gemm%':>6} {'attn%':>6} {'emb%':>5} {'opt%':>5} {'other%':>6} "
        f"{'peak GB':>8} {'ceil@1.9':>8} {'vs anchor':>9}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for record in records:
        row = csv_row(record)
        if record.get("error"):
            print(f"{record['model']:8} {record['mode']:9} ERROR {record['error'][:90]}")
            continue

        def pct(key: str, row: dict = row) -> str:
            return "-" if row[key] == "" else f"{100 * row[key]:.0f}"

        print(
            f"{record['model']:8} {record['mode']:9} {row['batch']:>6} {fmt(row['step_ms']):>8} "
            f"{fmt(row['e2e_ms']):>8} {fmt(row['gen_ms']):>7} "
            f"{100 * row['gen_share_of_e2e']:>5.1f} {pct('gemm_share'):>6} "
            f"{pct('attention_share'):>6} {pct('embedding_share'):>5} {pct('optimizer_share'):>5} "
            f"{pct('other_share'):>6} {fmt(row['peak_gb']):>8} "
            f"{fmt(row['fp8_ceiling_s1.9']):>8} {fmt(row['vs_anchor']):>9}"
        )
    print(
        f"anchor: DHEN-style, compiled bf16, batch 16384: {ANCHOR_DHEN_COMPILED_MS[0]}-"
        f"{ANCHOR_DHEN_COMPILED_MS[1]} ms/step (vs anchor > 1: faster than the anchor); "
        "ceil@1.9: step speedup if every GEMM ran 1.9x faster (FP8 alone cannot pass it)"
    )
    for record in records:
        shapes = record.get("profile", {}).get("gemm_shapes", [])[:6]
        if shapes:
            print(f"\n{record['model']} ({record['mode']}): top GEMM shapes, ms per step")
            for s in shapes:
                print(
                    f"  {s['op']:13} b={s['batch']:<6} M={s['M']:<8} K={s['K']:<6} N={s['N']:<6} "
                    f"x{s['calls_per_step']:<5.0f} {s['ms_per_step']:7.3f} ms "
                    f"{fmt(s['tflops'], 0):>5} TFLOP/s"
                )


def beauty_check(args: argparse.Namespace, device: torch.device, meta: dict) -> int:
    """SASRec (base preset, 20 recent items) trained on Beauty against the popularity
    baseline, on the validation split along the way and on both splits at the end."""
    setup = zoo.create("sasrec", "base", device=device, seed=0, dataset="beauty", max_seq_len=20)
    splits = {split: setup.eval_batches(split=split) for split in ("valid", "test")}
    baseline = setup.popularity_baseline()
    record: dict = {
        "model": "sasrec",
        "dataset": "beauty",
        "steps": args.beauty,
        "lr": 3e-3,
        **describe(setup),
        "popularity": {split: setup.metrics(baseline, b) for split, b in splits.items()},
        "curve": [],
    }
    optimizer = torch.optim.AdamW(setup.model.parameters(), lr=record["lr"])
    batches = setup.train_batches()
    every = max(1, args.beauty // 4)
    started = time.perf_counter()
    for step in range(1, args.beauty + 1):
        loss = zoo.training_step(setup, setup.model, optimizer, next(batches))
        if step % every == 0 or step == args.beauty:
            valid = setup.metrics(setup.model, splits["valid"])
            record["curve"].append(
                {
                    "step": step,
                    "loss": float(loss),
                    "valid": valid,
                    "elapsed_s": time.perf_counter() - started,
                }
            )
            print(f"[beauty] step {step}: loss {float(loss):.3f} valid {valid}", flush=True)
    record["sasrec"] = {split: setup.metrics(setup.model, b) for split, b in splits.items()}
    meta["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = out / f"zoo_sasrec_beauty_{device.type}_{stamp}.json"
    write_json(path, {"meta": meta, "result": record})
    print(f"\n{'split':6} {'model':10} {'hr@10':>7} {'ndcg@10':>8} {'mrr':>7}")
    for split in ("valid", "test"):
        for label, metrics in (
            ("popularity", record["popularity"][split]),
            ("sasrec", record["sasrec"][split]),
        ):
            print(
                f"{split:6} {label:10} {metrics['hr@10']:7.4f} {metrics['ndcg@10']:8.4f} "
                f"{metrics['mrr']:7.4f}"
            )
    print(f"\nwrote {path} ({meta['wall_s']:.0f} s)")
    return 0


def main() -> int:
    args = parse_args()
    if args.beauty:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not (args.smoke or args.beauty):
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "gpu"
    started = time.perf_counter()
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": device_name(device),
        "versions": versions(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "host": platform.node(),
        "args": vars(args),
        "anchor_dhen_compiled_ms": ANCHOR_DHEN_COMPILED_MS,
    }
    if args.beauty:
        return beauty_check(args, device, meta)
    models = [m for m in args.models.split(",") if m]
    to_compile = [m for m in args.compile.split(",") if m]
    records: list[dict] = []
    skipped: list[str] = []
    plan = [(m, False) for m in models] + [(m, True) for m in to_compile if m in models]
    for name, compiled in plan:
        left = args.budget_s - (time.perf_counter() - started)
        if compiled and left < args.compile_cost_s:
            skipped.append(f"{name} compiled ({left:.0f} s of budget left)")
            continue
        print(f"[zoo] {name} {'compiled' if compiled else 'eager'} ...", flush=True)
        t0 = time.perf_counter()
        try:
            record = run_model(name, args, device, compiled)
        except Exception as error:
            record = {
                "model": name,
                "mode": "compiled" if compiled else "eager",
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        # Free this model's memory (weights, optimizer state, batches) before the next.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record["wall_s"] = time.perf_counter() - t0
        records.append(record)
        print(
            f"[zoo]   {record.get('step_ms', float('nan')):.2f} ms/step, "
            f"{record['wall_s']:.0f} s"
            + (f"  ERROR {record['error']}" if "error" in record else ""),
            flush=True,
        )
    meta["skipped"] = skipped
    meta["wall_s"] = time.perf_counter() - started
    json_path, csv_path = write(records, meta, Path(args.out), mode)
    print_summary(records)
    if skipped:
        print("\nskipped for the budget: " + "; ".join(skipped))
    print(f"\nwrote {json_path} and {csv_path} ({meta['wall_s']:.0f} s)")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
