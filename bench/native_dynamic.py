"""The torch-native quantization compiled with a dynamic token count: what a jagged model pays.

HSTU xl's compiled plan predicted 1.151x from its measured bf16 step and ran 1.040x
(`bench/results/realized_20261202T141916Z`): 29% of the kernel time the bench said it would
save. Its batches are jagged, so after the second batch torch.compile (dynamic="auto") runs a
graph whose token count M is symbolic, while the bench times each quantization in a static
graph; an earlier bench run saw dynamic-shape reductions 3-8x slower (tensorwise amax 1.1-1.5
ms instead of ~0.1 ms at 16384 x 4096, with every dim symbolic). This script measures, at the
plan's shapes, each quantization `quantize_native` does:

- compiled static (what the bench times), compiled with M alone dynamic
  (`torch._dynamo.mark_dynamic(x, 0)`: what the jagged model runs) and with every dim dynamic;
- for tensor scales, the plain `amax()` beside the two-stage form that `quantize_native`
  takes for token rows under compile (`rows_vary=True`: `amax(dim=1).amax()`, the inner
  reduction over the static K, then one over M values), the same numbers bit for bit.
  Measured 2026-12-02 (`bench/results/native_dynamic_20261202T170340Z.json`): one-stage
  tensor amax 2.0-2.3x slower with M dynamic, two-stage within 1-5% of static.

- (`--sections bias`) a linear's bias gradient, `dY.sum(0)` (a column reduction over M)
  beside `ones[1, M] @ dY` (a GEMM), each alone and beside the dgrad's rowwise quantization
  of dY: what the kernel left in HSTU xl's profile after the two-stage amax runs
  (`bench/results/realized_20261202T172455Z_profiles`: 3.4 ms a call; bf16's 2.6 ms).

Rows: shape, granularity, transpose, variant, compile mode, milliseconds, GB/s, and whether
the output equals the static graph's. Results in --out: native_dynamic_<utc>.json.

    python3 bench/native_dynamic.py                      # HSTU xl and DHEN xl shapes
    python3 bench/native_dynamic.py --shapes 32320x3072,32320x12288
On the CPU (no GPU) it runs small shapes as a check of the script itself.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from harness import Budget, metadata, parser, stamp, time_ms, write_json

# HSTU xl: uvqk's input and output (32320 tokens), out's input; DHEN xl's 2048-wide input.
GPU_SHAPES = ((32320, 3072), (32320, 12288), (16384, 2048))
CPU_SHAPES = ((320, 64), (96, 128))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, budget_s=240.0)
    p.add_argument("--shapes", default=None, help="comma list of MxK (default: HSTU/DHEN xl)")
    p.add_argument("--fmt", default="e4m3")
    p.add_argument("--sections", default="quantize,bias",
                   help="quantize: each quantization; bias: the bias gradient (sum or GEMM); "
                        "serving: an activation and the quantization after it")  # fmt: skip
    return p.parse_args(argv)


def variants(fmt: str) -> dict[tuple[str, bool], object]:
    """(granularity/form, transpose) -> the function compiled."""
    from loka.kernels.native import quantize_native

    out = {}
    for transpose in (False, True):
        out["tensor", transpose] = functools.partial(
            quantize_native, fmt=fmt, granularity="tensor", transpose=transpose
        )
        out["row", transpose] = functools.partial(
            quantize_native, fmt=fmt, granularity="row", transpose=transpose
        )
    # What the native linear runs on token rows under compile (`rows_vary`): amax per row,
    # then over the rows; bit for bit the one-stage value.
    out["tensor-two-stage", False] = functools.partial(
        quantize_native, fmt=fmt, granularity="tensor", rows_vary=True
    )
    return out


def bias_gradient_variants(fmt: str) -> dict[tuple[str, bool], object]:
    """A linear's bias gradient (`dY.sum(0)`, a column reduction over the tokens M) alone
    and beside the dgrad's rowwise quantization of dY, as a reduction and as a GEMM with a
    ones row (`ones[1, M] @ dY`: tensor cores, no reduction over a symbolic M). HSTU xl's
    compiled step spends 3.4 ms a call in the kernel that fuses its uvqk bias gradient with
    that quantization, and bf16's own bias-gradient kernel 2.6 ms: 0.8 GB read each."""
    from loka.kernels.native import quantize_native

    def bias_sum(t):
        return t.sum(0)

    def bias_gemm(t):
        return (t.new_ones(1, t.shape[0]) @ t)[0]

    def with_quantization(bias):
        def run(t):
            return (*quantize_native(t, fmt, "row", rows_vary=True), bias(t))

        return run

    return {
        ("bias-sum", False): bias_sum,
        ("bias-gemm", False): bias_gemm,
        ("row+bias-sum", False): with_quantization(bias_sum),
        ("row+bias-gemm", False): with_quantization(bias_gemm),
    }


def serving_variants(fmt: str) -> dict[tuple[str, bool], object]:
    """What a served forward runs before an FP8 linear: the activation that feeds it (ReLU
    in Wukong, GELU in DHEN) and its quantization, which inductor fuses into one kernel.
    DHEN xl's served forward (`bench/results/realized_20261202T204815Z`) spends 0.224 ms a
    call in GELU + rowwise quantization at 16384 x 4096, where bf16's GELU alone takes
    0.096 ms: a looped reduction over K that reads each row twice. Beside it: a tensor
    scale, and a fixed scale (no amax at all: the floor of any calibrated scale); the
    `multi-kernel` compile mode lets inductor pick a persistent reduction at run time. (A
    rowwise amax in two stages, per chunk of K first, gained nothing:
    `bench/results/native_dynamic_20261203T030324Z.json`.)"""
    import torch

    from loka.kernels.native import quantize_native
    from loka.schema.fp8 import saturate_cast

    def fixed_scale(t):
        scale = t.new_full((), 8.0, dtype=torch.float32)
        return saturate_cast(t, scale, fmt), scale.reciprocal()

    out = {}
    for act_name, act in (("relu", torch.relu), ("gelu", torch.nn.functional.gelu)):

        def chain(quant, act=act):
            return lambda t: quant(act(t))

        out[act_name, False] = act
        out[f"{act_name}+row", False] = chain(functools.partial(quantize_native, fmt=fmt, granularity="row"))  # fmt: skip
        out[f"{act_name}+tensor", False] = chain(functools.partial(quantize_native, fmt=fmt, granularity="tensor"))  # fmt: skip
        out[f"{act_name}+fixed-scale", False] = chain(fixed_scale)
    return out


# Bytes moved per element of the source: read bf16, write FP8 (where quantized).
BYTES_PER_ELEMENT = {"bias-sum": 2, "bias-gemm": 2, "relu": 4, "gelu": 4}
# Compile modes: the dynamic marks, or inductor options (static shapes).
DYNAMIC = {"static": False, "dynamic-M": None, "dynamic-all": True, "multi-kernel": False}
OPTIONS = {"multi-kernel": {"triton.multi_kernel": 1}}


def compiled(fn, mode: str):
    """`fn` compiled for `mode`: a fresh wrapper per call site, so that dynamo's cache of
    one mode never serves another (the cache is per code object)."""
    import torch

    def run(t):
        return fn(t)

    run.__code__ = run.__code__.replace()  # its own code object: its own dynamo cache
    return torch.compile(run, dynamic=DYNAMIC[mode], options=OPTIONS.get(mode))


def measure(source, name, transpose, fn, mode, device, reference) -> dict:
    """One variant in one compile mode on a copy of `source` (the same values in every mode,
    so that the outputs compare; a copy, since marking a dim dynamic marks the tensor)."""
    import torch

    M, K = source.shape
    x = source.clone()
    if mode == "dynamic-M":
        torch._dynamo.mark_dynamic(x, 0)
    run = compiled(fn, mode)
    with torch._dynamo.config.patch(recompile_limit=64):
        t0 = time.monotonic()
        out = run(x)
        out = out if isinstance(out, tuple) else (out,)
        compile_s = time.monotonic() - t0
        ms = time_ms(lambda: run(x), device)
    same = None
    if reference is not None:
        same = all(torch.equal(a.float(), b.float()) for a, b in zip(out, reference, strict=True))
    moved = M * K * BYTES_PER_ELEMENT.get(name, 3)  # a transpose writes the same bytes
    return {"M": M, "K": K, "variant": name, "transpose": transpose, "compile": mode,
            "ms": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9, "compile_s": compile_s,
            "equal_to_static": same, "_out": out}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = list(GPU_SHAPES if device == "cuda" else CPU_SHAPES)
    budget = Budget(args.budget_s)
    rows, skipped = [], []
    for shape in shapes:
        generator = torch.Generator(device).manual_seed(0)
        source = torch.randn(*shape, device=device, generator=generator).to(torch.bfloat16)
        chosen = {}
        if "quantize" in args.sections:
            chosen |= variants(args.fmt)
        if "bias" in args.sections:
            chosen |= bias_gradient_variants(args.fmt)
        serving = serving_variants(args.fmt) if "serving" in args.sections else {}
        for (name, transpose), fn in (chosen | serving).items():
            static = None
            # Serving batches are fixed: static graphs, and inductor's multi-kernel (a
            # looped and a persistent reduction, the faster chosen at run time) for rows.
            modes = ("static", "dynamic-M", "dynamic-all")
            if (name, transpose) in serving:
                modes = ("static", "multi-kernel") if name.endswith("+row") else ("static",)
            for mode in modes:
                if budget.over():
                    skipped.append(f"{shape} {name} transpose={transpose} {mode}")
                    continue
                row = measure(source, name, transpose, fn, mode, device, static)
                if mode == "static":
                    static = row["_out"]
                del row["_out"]
                rows.append(row)
                print(f"[native_dynamic {budget.elapsed():5.0f} s] {shape[0]}x{shape[1]} "
                      f"{name:17s} T={int(transpose)} {mode:11s} {row['ms']:8.4f} ms "
                      f"{row['gb_per_s']:7.0f} GB/s equal={row['equal_to_static']}", flush=True)  # fmt: skip
    path = Path(args.out) / f"native_dynamic_{stamp()}.json"
    write_json(path, {"meta": metadata(device, fmt=args.fmt, shapes=shapes, skipped=skipped),
                      "rows": rows})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
