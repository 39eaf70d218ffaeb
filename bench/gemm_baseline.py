"""Does the kernel bench time a GEMM the way a training step runs it?

In DHEN xl's MLP block (`bench/results/wgrad_in_graph_20261203T140008Z`) the bf16 GEMMs ran
faster in place than the kernel bench times them (fc1's forward 0.353 ms in the profile
against the bench's 0.459; its wgrad 0.334 against 0.389), while the FP8 GEMMs matched
(0.19-0.21 against 0.21): every speedup near the margin is then optimistic. This script
times the same GEMMs several ways, one shape at a time, bf16 and FP8 (e4m3 rowwise,
pre-quantized: `torch._scaled_mm`) side by side:

- ``bench``: `PassTimer.time`, exactly as the kernel bench does (a CUDA graph of
  back-to-back calls, inputs rotated past the L2);
- ``graph+bias``: the same CUDA-graph method on one set of operands (no rotation), the
  forward with the bias an `nn.Linear` adds (`addmm`: cuBLAS may pick another kernel);
- ``do_bench``: Triton's `do_bench` (L2 flushed before each call, one call at a time);
- ``in_step``: the GEMM's own kernel time from `torch.profiler`, each call between
  memory-bound elementwise work over 128 MB (a GELU and its backward's shape of traffic),
  as inside a step: what a profile of the real step would show for it;
- ``graph+spacer``: the bench's CUDA-graph method with that elementwise work between the
  calls, less a graph of the elementwise work alone: a timing method the bench could use
  if ``in_step`` shows the back-to-back calls are what make ``bench`` slow;
- ``fresh_a``: the GEMM right after the kernel that writes its first operand, as in a step
  (bf16: a copy writes A; FP8: A's rowwise quantization writes its bytes and scales), less
  that kernel alone, both as CUDA graphs without rotation: A is then partly in the L2 when
  the GEMM reads it, FP8's half-size A more so. Whether that is why a planned step's FP8
  GEMMs ran 6-11% faster than the bench times them (DHEN, Wukong, HSTU and InterFormer xl,
  `prediction_parts` of `realized_20261203T174956Z` and `..220217Z`) while bf16's agreed.
  It is not (`gemm_baseline_20261203T235917Z`: FP8 `fresh_a` within 0-4% of `bench` at
  DHEN's and Wukong's shapes, e.g. 0.218 vs 0.218 ms, 0.191 vs 0.198, 0.772 vs 0.766);
- ``after_idle`` (with ``--idle-s S``): ``bench`` again, each dtype's timing after S seconds
  of an idle GPU, as the kernel bench's first rows follow a model's probing and compiling
  (host work): whether a GPU coming out of idle clocks is what makes ``bench`` slow.

Rows: shape, pass, method, bf16 ms, FP8 ms, their ratio; results in --out as
gemm_baseline_<utc>.json. With `--clocks` (forward passes; needs NVML through `pynvml`),
rows ``clocks`` record the SM clock and power drawn over a second of back-to-back calls
and a second of calls between the elementwise traffic: whether the bench's back-to-back
GEMMs run at lower clocks than a step's.

    python3 bench/gemm_baseline.py                       # DHEN / Wukong / HSTU xl shapes
    python3 bench/gemm_baseline.py --shapes 16384x2048x4096
On the CPU it runs tiny shapes with wall clocks and without the FP8 GEMM (rowwise
`_scaled_mm` is CUDA-only): a check of the script, not of any speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import (
    Budget,
    device_kernels,
    metadata,
    parser,
    profile_events,
    stamp,
    time_ms,
    write_json,
)

# M x K x N of xl linears: DHEN's fc1 and fc2, Wukong's interaction MLP, HSTU's uvqk.
SHAPES = ("16384x2048x4096", "16384x4096x2048", "16384x8192x4096", "32768x3072x12288")
PASSES = ("fwd", "wgrad")
METHODS = ("bench", "graph+bias", "do_bench", "in_step", "graph+spacer", "fresh_a")
ROW = "e4m3:e4m3/row/dynamic"
SPACER_BYTES = 128 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=120.0)
    p.add_argument("--shapes", default=None, help=f"comma list of MxKxN ({','.join(SHAPES)})")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--calls", type=int, default=20, help="profiled calls per in_step timing")
    p.add_argument("--clocks", action="store_true", help="SM clock and power under each duty")
    p.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="also time `bench` after this many idle seconds (method after_idle)",
    )
    args = p.parse_args(argv)
    for pass_ in args.passes.split(","):
        if pass_ not in PASSES:
            p.error(f"--passes: unknown {pass_!r} (known: {', '.join(PASSES)})")
    return args


def shape_of(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a shape is MxKxN, got {text!r}") from None
    return m, k, n


def operands(M: int, K: int, N: int, pass_: str, device: str) -> dict:
    """bf16 operands of `pass_` as a step's autograd hands them to the GEMM (wgrad: dY^T and
    x as transposed views), and their FP8 rowwise forms (None on the CPU)."""
    import torch

    from loka.kernels.native import quantize_native

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int):
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    if pass_ == "fwd":  # y = x W^T (+ b)
        a, b = rand(M, K), rand(N, K)
    else:  # dW = dY^T x: [N, M] @ [M, K]; as F.linear(dY^T, x^T)
        a, b = rand(M, N).t(), rand(M, K).t()
    out = {"a": a, "b": b, "bias": rand(b.shape[0]), "fp8": None}
    if device == "cuda":
        qa, ia = quantize_native(a.contiguous(), "e4m3", "row")
        qb, ib = quantize_native(b.contiguous(), "e4m3", "row")
        out["fp8"] = (qa, ia, qb, ib)
    return out


def gemm_calls(ops: dict) -> dict:
    """The bf16 and FP8 GEMM calls of one pass (FP8 absent on the CPU)."""
    import torch.nn.functional as F

    from loka.kernels.native import native_mm

    a, b, bias = ops["a"], ops["b"], ops["bias"]
    calls = {"bf16": lambda: F.linear(a, b), "bf16+bias": lambda: F.linear(a, b, bias)}
    if ops["fp8"] is not None:
        qa, ia, qb, ib = ops["fp8"]
        calls["fp8"] = lambda: native_mm(qa, ia, qb, ib)
        calls["fp8+bias"] = lambda: native_mm(qa, ia, qb, ib, bias)
    return calls


def graph_calls(ops: dict, pass_: str) -> dict:
    """The calls `graph+bias` times: with the bias for the forward, without for the wgrad."""
    calls = gemm_calls(ops)
    suffix = "+bias" if pass_ == "fwd" else ""
    return {k: calls[k + suffix] for k in ("bf16", "fp8") if k in calls}


def bench_ms(M: int, K: int, N: int, pass_: str, device: str, idle_s: float = 0.0) -> dict:
    """bf16 and FP8 GEMM milliseconds as the kernel bench times them (`PassTimer.time`),
    each after `idle_s` seconds of an idle device."""
    import time

    import torch

    from loka.dispatch.bench.candidates import Candidate
    from loka.dispatch.bench.timing import PassTimer

    timer = PassTimer(M, K, N, device)
    candidates = {"bf16": Candidate("torch.bf16", "bf16", pass_)}
    if device == "cuda":
        candidates["fp8"] = Candidate("torch.scaled_mm", ROW, pass_)
    out = {}
    for name, candidate in candidates.items():
        if idle_s > 0:
            if device == "cuda":
                torch.cuda.synchronize()
            time.sleep(idle_s)
        out[name] = timer.time(candidate).gemm_ms
    return out


def graph_ms(fn, device: str) -> float:
    """The kernel bench's CUDA-graph median (a wall clock on the CPU)."""
    from loka.dispatch.bench import timing

    if device == "cuda":
        return timing._median_cuda_graph(fn, 4.0, 7)
    return timing._median_wall(fn)


def make_spacer(device: str):
    """A call of memory-bound elementwise work over SPACER_BYTES (a GELU of float32), what
    a step runs between its GEMMs; on the CPU a small one (the tiny GEMM beside it)."""
    import torch
    import torch.nn.functional as F

    spacer_in = torch.randn((SPACER_BYTES if device == "cuda" else 2**16) // 4, device=device)
    return lambda: F.gelu(spacer_in)


def graph_spacer_ms(fn, device: str) -> float:
    """`graph_ms` of the spacer then `fn`, less `graph_ms` of the spacer alone."""
    spacer = make_spacer(device)
    pair = graph_ms(lambda: (spacer(), fn()), device)
    return max(pair - graph_ms(spacer, device), 0.0)


def fresh_a_ms(ops: dict, device: str) -> dict:
    """bf16 and FP8 GEMM milliseconds right after the kernel that writes the GEMM's first
    operand (`fresh_a`), less that kernel's own `graph_ms`."""
    import torch.nn.functional as F

    from loka.kernels.native import native_mm, quantize_native

    a, b = ops["a"], ops["b"]
    written = a.clone()  # a's layout (the wgrad's transposed view included)

    def write_bf16():
        written.copy_(a)

    out = {"bf16": max(graph_ms(lambda: (write_bf16(), F.linear(written, b)), device)
                       - graph_ms(write_bf16, device), 0.0)}  # fmt: skip
    if ops["fp8"] is not None:
        _, _, qb, ib = ops["fp8"]
        source = a.contiguous()

        def quantize():
            return quantize_native(source, "e4m3", "row")

        def pair():
            qa, ia = quantize()
            return native_mm(qa, ia, qb, ib)

        out["fp8"] = max(graph_ms(pair, device) - graph_ms(quantize, device), 0.0)
    return out


def in_step_ms(fn, device: str, calls: int) -> float:
    """The GEMM's kernel time per call from torch.profiler, each call after ~128 MB of
    elementwise work (a step's duty cycle); on the CPU (no profiled kernels),
    `graph_spacer_ms`'s wall clocks."""
    if device != "cuda":
        return graph_spacer_ms(fn, device)
    spacer = make_spacer(device)
    for _ in range(3):
        spacer(), fn()
    names_before = {e.key for e in device_kernels(profile_events(lambda i: spacer(), 2))}
    events = device_kernels(profile_events(lambda i: (spacer(), fn()), calls))
    gemm = [e for e in events if e.key not in names_before]
    return sum(e.self_device_time_total for e in gemm) / 1e3 / calls


def clocks(fn, device: str, seconds: float = 1.0) -> dict | None:
    """Median SM clock (MHz) and power (W) NVML reports while `fn` runs back to back and
    while it runs between the elementwise traffic, `seconds` each (None without NVML: the
    CPU, or no `pynvml`). NVML's sample period is 1/6-1 s, hence whole seconds."""
    import threading
    import time

    import torch

    if device != "cuda":
        return None
    try:
        torch.cuda.clock_rate(), torch.cuda.power_draw()
    except Exception:  # no NVML binding on this host
        return None
    spacer = make_spacer(device)
    out = {}
    for duty, call in (("back_to_back", fn), ("spaced", lambda: (spacer(), fn()))):
        samples, done = [], threading.Event()

        def sample(samples=samples, done=done) -> None:
            while not done.is_set():
                samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3))
                time.sleep(0.05)

        thread = threading.Thread(target=sample)
        end = time.perf_counter() + seconds
        thread.start()
        while time.perf_counter() < end:
            for _ in range(8):
                call()
            torch.cuda.synchronize()
        done.set()
        thread.join()
        out[duty] = {"sm_mhz": statistics.median(c for c, _ in samples),
                     "power_w": statistics.median(w for _, w in samples)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = (args.shapes or (",".join(SHAPES) if device == "cuda" else "64x32x48")).split(",")
    budget, rows, skipped = Budget(args.budget_s), [], []
    for text in shapes:
        M, K, N = shape_of(text)
        for pass_ in args.passes.split(","):
            if budget.over():
                skipped.append(f"{text} {pass_}")
                continue
            ops = operands(M, K, N, pass_, device)
            calls = gemm_calls(ops)
            measured = {"bench": bench_ms(M, K, N, pass_, device)}
            measured["graph+bias"] = {
                k: graph_ms(f, device) for k, f in graph_calls(ops, pass_).items()
            }
            plain = {k: f for k, f in calls.items() if not k.endswith("+bias")}
            measured["do_bench"] = {k: time_ms(f, device) for k, f in plain.items()}
            measured["in_step"] = {k: in_step_ms(f, device, args.calls) for k, f in plain.items()}
            measured["graph+spacer"] = {k: graph_spacer_ms(f, device) for k, f in plain.items()}
            measured["fresh_a"] = fresh_a_ms(ops, device)
            if args.idle_s > 0:
                measured["after_idle"] = bench_ms(M, K, N, pass_, device, args.idle_s)
            for method in measured:
                ms = measured[method]
                bf16, fp8 = ms["bf16"], ms.get("fp8")
                row = {"shape": text, "pass": pass_, "method": method, "bf16_ms": bf16,
                       "fp8_ms": fp8, "speedup": bf16 / fp8 if fp8 else None}  # fmt: skip
                rows.append(row)
                speedup = "" if fp8 is None else f"fp8 {fp8:7.3f} ms  {bf16 / fp8:.3f}x"
                print(f"[gemm_baseline {budget.elapsed():4.0f} s] {text:17s} {pass_:5s} "
                      f"{method:10s} bf16 {bf16:7.3f} ms  {speedup}", flush=True)  # fmt: skip
            if args.clocks and pass_ == "fwd":
                got = {k: clocks(f, device) for k, f in plain.items()}
                rows.append({"shape": text, "pass": pass_, "method": "clocks", "clocks": got})
                print(f"[gemm_baseline {budget.elapsed():4.0f} s] {text:17s} {pass_:5s} "
                      f"clocks     {got}", flush=True)  # fmt: skip
            del ops, calls
    meta = metadata(device, skipped=skipped, recipe=ROW, spacer_bytes=SPACER_BYTES,
                    calls=args.calls, idle_s=args.idle_s)  # fmt: skip
    path = write_json(
        Path(args.out) / f"gemm_baseline_{stamp()}.json", {"meta": meta, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
