"""What a compiled forward pays to quantize its input: standalone, or fused into the op that
computed it (the planner's item 5a).

For each M x K x N and producer kind, the kernel bench's own rows (`benchmark`, compiled by
inductor as a compiled plan's model runs them): the bf16 forward GEMM, the traceable FP8
forward (`torch.native`, e4m3 rowwise and tensorwise: its GEMM and its quantizations of x and
W), and the producer rows at (M, K): the op alone, the op fused with quantizing its output
(bf16 output kept), the standalone quantization of x. Per recipe it reports the FP8 forward
costed both ways and its speedup over bf16 each way: whether the fusion turns a forward
that loses (DHEN xl's fc2, K = 4096, fed by GELU: "not 1.05x faster than bf16" on an H100)
into one that wins. Results go to --out as producer_rows_<utc>.json.

    python3 bench/producer_rows.py                     # DHEN xl's fc1 (norm) and fc2 (GELU)
    python3 bench/producer_rows.py --shapes 16384x4096x2048:pointwise
On the CPU it times tiny shapes with wall clocks: a check of the script, not of any speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness import metadata, parser, stamp, write_json

# M x K x N : the kind of op computing x. DHEN xl: fc1 after its LayerNorm, fc2 after GELU.
SHAPES = ("16384x2048x4096:norm", "16384x4096x2048:pointwise")
CPU_SHAPES = ("32x64x32:norm", "32x64x32:pointwise")
RECIPES = ("e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic")


def parse_shapes(text: str) -> list[tuple[int, int, int, str]]:
    from loka.dispatch.bench.candidates import PRODUCER_OPS

    out = []
    for item in filter(None, text.split(",")):
        dims, _, kind = item.partition(":")
        try:
            M, K, N = (int(d) for d in dims.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxKxN:kind") from None
        if kind not in PRODUCER_OPS:
            raise argparse.ArgumentTypeError(
                f"shape {item!r}: kind must be one of {sorted(PRODUCER_OPS)}"
            )
        out.append((M, K, N, kind))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help=f"comma list of MxKxN:kind ({','.join(SHAPES)})")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    return p.parse_args(argv)


def costed(rows: list[dict], M: int, K: int, N: int, kind: str) -> list[dict]:
    """Per recipe: the FP8 forward's time standalone and with x's quantization fused into
    the producer (the planner's arithmetic), beside bf16's."""
    from loka.dispatch.bench import m_bucket, speed_key
    from loka.dispatch.bench.candidates import (
        QUANTIZE_BACKEND,
        in_graph_quant_ms,
        producer_backend,
    )

    Mb = m_bucket(M)

    def one(backend: str, recipe: str, n: int) -> dict | None:
        return next(
            (r for r in rows if r["backend"] == backend and speed_key(r["recipe"]) == speed_key(recipe)
             and r["pass"] == "fwd" and r["M_bucket"] == Mb and r["K"] == K and r["N"] == n),
            None,
        )  # fmt: skip

    bf16, op = one("torch.bf16", "bf16", N), one(producer_backend(kind, False), "bf16", 0)
    out = []
    for recipe in RECIPES:
        fp8, alone = one("torch.native", recipe, N), one(QUANTIZE_BACKEND, recipe, 0)
        fused = one(producer_backend(kind, True), recipe, 0)
        if None in (bf16, op, fp8, alone, fused):
            continue
        in_graph = fp8["gemm_ms"] + in_graph_quant_ms(
            fp8["quant_ms"], alone["median_ms"], op["median_ms"], fused["median_ms"]
        )
        out.append({
            "M": M, "K": K, "N": N, "kind": kind, "recipe": recipe,
            "bf16_ms": bf16["median_ms"], "fp8_gemm_ms": fp8["gemm_ms"],
            "fp8_quant_ms": fp8["quant_ms"], "quantize_x_ms": alone["median_ms"],
            "op_ms": op["median_ms"], "op_quantize_ms": fused["median_ms"],
            "fp8_standalone_ms": fp8["median_ms"], "fp8_in_graph_ms": in_graph,
            "speedup_standalone": bf16["median_ms"] / fp8["median_ms"],
            "speedup_in_graph": bf16["median_ms"] / in_graph,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported
    from loka.dispatch.bench import Shape, benchmark

    shapes = args.shapes or parse_shapes(",".join(SHAPES if device == "cuda" else CPU_SHAPES))
    result = benchmark(
        [Shape(M, K, N) for M, K, N, _ in shapes], device=device,
        time_on_cpu=device == "cpu", backends=["torch.bf16", "torch.native"],
        recipes={"fwd": list(RECIPES), "dgrad": [], "wgrad": []},
        producer_shapes=[(M, K, kind, "fwd") for M, K, _, kind in shapes],
        retime_baselines=False,
    )  # fmt: skip
    rows = result.table.to_dicts()
    table = [row for M, K, N, kind in shapes for row in costed(rows, M, K, N, kind)]
    print(f"{'shape':>20} {'kind':>9} {'recipe':>24} {'bf16':>7} {'alone':>7} {'in graph':>8}"
          f" {'x alone':>7} {'op+q - op':>9}")  # fmt: skip
    for r in table:
        shape = "x".join(str(r[d]) for d in "MKN")
        print(f"{shape:>20} {r['kind']:>9} {r['recipe']:>24} "
              f"{r['bf16_ms']:7.4f} {r['fp8_standalone_ms']:7.4f} {r['fp8_in_graph_ms']:8.4f} "
              f"{r['quantize_x_ms']:7.4f} {r['op_quantize_ms'] - r['op_ms']:9.4f}")  # fmt: skip
    path = Path(args.out) / f"producer_rows_{stamp()}.json"
    write_json(path, {"meta": metadata(device), "costed": table, "rows": rows,
                      "failed": [f"{s} {c}: {why}" for s, c, why in result.failed]})  # fmt: skip
    print(f"wrote {path}")
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
