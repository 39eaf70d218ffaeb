"""Where an eager FP8 pass's host time goes: one `Fp8Linear` pass against `nn.Linear`, profiled.

`loka.dispatch.bench.host.host_overhead_ms` measured 0.6-1.4 ms of extra host time per FP8
pass on the H200's host (eager, weight touched before every call as after an optimizer
step), where the kernels' own launches cost 30-130 us each (kernels README, "Host
overhead") and LoKA's Python, with the kernels stubbed on a CPU, about 0.1 ms for all three
passes. So eager plans stay bf16 (DHEN xl eager: a plan on device time alone ran 0.820x).
This script splits that time: for each pass in FP8 alone (the others bf16), and for the
three together, it times host milliseconds per fwd+bwd call with and without the weight
touched (the refresh of its FP8 copies, once per optimizer step in training) and profiles
the FP8 call (`torch.profiler`, CPU side): the top host functions and ops by self CPU time,
and the launch count per call. `--regional` adds the torch-native linear compiled on its own
(`module.compile()`), the candidate path for eager models: inductor's fused quantizations
behind one compiled call per site instead of a Python autograd function and a launch per
kernel. Results in --out: host_profile_<utc>.json.

    python3 bench/host_profile.py --regional               # K = N = 4096, row recipes
    python3 bench/host_profile.py --backend triton.fp8 --recipe e4m3:e4m3/tensor/dynamic
On the CPU it runs the native backend (`torch.native.cpu`: plain torch ops, not the GPU's
code path), or with `--stub-device` the GPU's path itself (`--backend`, default
`torch.scaled_mm`: the `Fp8LinearFunction`, the `loka_mods` ops, `fp8_mm`) with its device
work (the Triton quantizations, `torch._scaled_mm`) replaced by allocations of the right
shapes, so what is timed is LoKA's own Python and aten ops on that path: a proxy for the
H200 host's share that the code can change (its launches cost the GPU host more).

    python bench/host_profile.py --stub-device --M 16 --calls 50   # on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from unittest import mock

from harness import Budget, metadata, parser, stamp, write_json

PASS_SETS = (("fwd",), ("dgrad",), ("wgrad",), ("fwd", "dgrad", "wgrad"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=180.0)
    p.add_argument("--backend", default="torch.scaled_mm")
    p.add_argument("--recipe", default="e4m3:e4m3/row/dynamic")
    p.add_argument("--K", type=int, default=None)
    p.add_argument("--N", type=int, default=None)
    p.add_argument("--M", type=int, default=128, help="small: the device stays ahead")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--graphs", choices=("both", "on", "off"), default="both",
                   help="Fp8LinearConfig.eager_graphs for the kernel backend's rows: both "
                        "runs each pass set with and without (A/B in one process)")  # fmt: skip
    p.add_argument("--wall-M", type=int, default=16384,
                   help="also wall ms per fwd+bwd at this M (device-bound), FP8 (all three "
                        "passes) with and without graphs against nn.Linear; 0: skip")  # fmt: skip
    p.add_argument("--regional", action="store_true",
                   help="also the torch-native linear compiled on its own (module.compile()): "
                        "the host cost of an eager model whose FP8 sites alone are compiled")  # fmt: skip
    p.add_argument("--stub-device", action="store_true",
                   help="CPU only: run --backend's own path with its device work stubbed by "
                        "allocations (LoKA's host code on the GPU's path, see above)")  # fmt: skip
    args = p.parse_args(argv)
    if args.stub_device and args.regional:
        p.error("--stub-device times the eager path; --regional compiles: run them apart")
    return args


@contextlib.contextmanager
def stubbed_device_work(backend_name: str):
    """`backend_name` made runnable on the CPU, with the FP8 quantizations and
    `torch._scaled_mm` returning empty tensors of their outputs' shapes and dtypes: the
    Python and aten ops around them run as on the GPU. Restored on exit."""
    import torch

    from loka.kernels import Fp8Tensor, registry
    from loka.kernels.formats import check_high_precision_2d
    from loka.mods import ops

    def quantize(x, config, amax=None):
        rows, cols = check_high_precision_2d(x).shape
        scales = [torch.empty(config.scale_shape(rows, cols)) for _ in range(3)]
        data = torch.empty((rows, cols), dtype=config.dtype)
        return Fp8Tensor._trusted(data, *scales, config.fmt, config.granularity, config.block)

    def quantize_transpose(x, config, amax=None):
        x = check_high_precision_2d(x)
        return quantize(x, config), quantize(x.t(), config)

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or torch.bfloat16)

    original = registry.get(backend_name)
    cpu = dataclasses.replace(original, runs_on_cpu=True, min_capability=None)
    with contextlib.ExitStack() as stack:
        registry.register(cpu, replace=True)
        stack.callback(registry.register, original, replace=True)
        stack.enter_context(mock.patch.object(ops, "quantize_with", quantize))
        stack.enter_context(mock.patch.object(ops, "quantize_transpose_with", quantize_transpose))
        stack.enter_context(mock.patch.object(torch, "_scaled_mm", scaled_mm))
        yield


def profile(module, x, calls: int, top: int) -> dict:
    """The FP8 call's host side under torch.profiler: top ops by self CPU time, launches."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with torch.profiler.profile(activities=activities, with_stack=False) as prof:
        for _ in range(calls):
            with torch.no_grad():
                module.weight.add_(0.0)
            module(x).sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cuLaunchKernelEx"))  # fmt: skip
    return {
        "launches_per_call": launches / calls,
        "top_self_cpu": [
            {
                "op": e.key,
                "calls_per_call": e.count / calls,
                "self_cpu_us_per_call": e.self_cpu_time_total / calls,
            }
            for e in rows
        ],
    }


def wall_ms(args, K: int, N: int, device: str, backend: str, baseline) -> dict:
    """Wall ms per fwd+bwd (weight touched) at M = --wall-M, where the device is the slower
    side: the graphs must not cost device time. Interleaved rounds, medians."""
    import statistics
    import time

    import torch

    from loka.mods import Fp8Linear, Fp8LinearConfig

    x = torch.randn(args.wall_M, K, device=device, requires_grad=True)
    modules = {"nn.Linear": baseline}
    for graphs in (True, False):
        config = Fp8LinearConfig.from_recipes(args.recipe, args.recipe, args.recipe,
                                              backend=backend).replace(eager_graphs=graphs)  # fmt: skip
        modules[f"fp8 graphs={graphs}"] = Fp8Linear(K, N, device=device, config=config)
    times: dict[str, list[float]] = {name: [] for name in modules}

    def call(module) -> None:
        with torch.no_grad():
            module.weight.add_(0.0)
        module(x).sum().backward()

    for _ in range(5):
        for name, module in modules.items():
            for _ in range(3):
                call(module)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                call(module)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / 10)
    out = {name: statistics.median(v) for name, v in times.items()}
    print("[host_profile] wall ms per fwd+bwd at M=" + str(args.wall_M) + ": "
          + ", ".join(f"{n} {v:.3f}" for n, v in out.items()), flush=True)  # fmt: skip
    return {"M": args.wall_M, "median_ms": out, "raw_ms": times}


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch import nn

    from loka.dispatch.bench.host import host_ms_per_call
    from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig

    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    K = args.K or (4096 if gpu else 64)
    N = args.N or (4096 if gpu else 64)
    if args.stub_device and gpu:
        print("host_profile: --stub-device is for a CPU host (a GPU runs the real kernels)",
              file=sys.stderr)  # fmt: skip
        return 2
    backend = args.backend if gpu or args.stub_device else "torch.native.cpu"
    budget = Budget(args.budget_s)
    stub = stubbed_device_work(backend) if args.stub_device else contextlib.nullcontext()
    torch.manual_seed(0)
    x = torch.randn(args.M, K, device=device, requires_grad=True)
    baseline = nn.Linear(K, N, device=device)
    rows = []
    with stub, torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
        base = {t: host_ms_per_call(baseline, x, t, args.calls) for t in (False, True)}
        print(f"[host_profile] nn.Linear fwd+bwd {base[False]:.3f} ms host "
              f"(weight touched: {base[True]:.3f})", flush=True)  # fmt: skip
        native = "torch.native" if gpu else "torch.native.cpu"
        graph_modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.graphs]
        runs = [(p, backend, False, g) for p in PASS_SETS for g in graph_modes]
        if args.regional:
            runs += [(passes, native, True, False) for passes in PASS_SETS]
        for passes, run_backend, regional, graphs in runs:
            if budget.over():
                rows.append({"passes": list(passes), "backend": run_backend,
                             "regional": regional, "error": "skipped: over the time budget"})  # fmt: skip
                continue
            config = Fp8LinearConfig(**{
                p: PassConfig(args.recipe, run_backend) if p in passes else PassConfig("bf16")
                for p in ("fwd", "dgrad", "wgrad")
            }, eager_graphs=graphs)  # fmt: skip
            module = Fp8Linear(K, N, device=device, config=config)
            if regional:
                module.compile(fullgraph=True)
            row = {"passes": list(passes), "backend": run_backend, "regional": regional,
                   "eager_graphs": graphs}  # fmt: skip
            for touch in (False, True):
                ms = host_ms_per_call(module, x, touch, args.calls)
                row["host_ms_touched" if touch else "host_ms"] = ms
                row["extra_ms_touched" if touch else "extra_ms"] = ms - base[touch]
            row |= profile(module, x, min(args.calls, 20), args.top)
            if module.eager_graphs is not None:
                stats = module.eager_graphs.stats
                row["graph_stats"] = {"replays": stats.replays, "captures": stats.captures,
                                      "eager": dict(stats.eager)}  # fmt: skip
            rows.append(row)
            graphs_label = " graphs" if graphs and not regional else ""
            label = f"{'+'.join(passes)}{' compiled alone' if regional else ''}{graphs_label}"
            print(f"[host_profile] FP8 {label:32s} extra host {row['extra_ms']:.3f} ms"
                  f" (weight touched {row['extra_ms_touched']:.3f}), "
                  f"{row['launches_per_call']:.0f} launches per call", flush=True)  # fmt: skip
        wall = wall_ms(args, K, N, device, backend, baseline) if gpu and args.wall_M else {}
    path = Path(args.out) / f"host_profile_{stamp()}.json"
    meta = metadata(device, backend=backend, recipe=args.recipe, M=args.M, K=K, N=N,
                    stub_device=args.stub_device)  # fmt: skip
    write_json(path, {"meta": meta, "baseline_ms": base, "rows": rows, "wall_ms": wall})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
