"""LoRDBA's sign-GEMM kernels under torch.compile on the GPU: does a compiled `LoRDBALinear`
compute what the eager one does, gradients included, and how many graphs and breaks does it
take?

The CPU tests compile the torch reference backend only (`packages/lordba/tests/test_compile.py`):
in Triton's interpreter Dynamo traces into the interpreter itself and fails, so the Triton
path under compile is a GPU question. For each base (plain bf16 linear, `Fp8WeightOnlyLinear`),
training and inference, the module with `backend="triton"` is compiled (inductor, dynamic
token count) and run on three token counts beside an identical eager module; rows record the
largest output and gradient differences (relative to the eager values' largest magnitude),
graph breaks and graphs compiled, or the error. `--time`: also ms per training step
(forward + backward) of one LoRDBA linear at a Llama-sized shape, eager (the Triton kernels)
against compiled (the references, inductor), interleaved rounds, medians: whether compiling
a LoRDBA model costs the kernels' speed. Results: lordba_compile_<utc>.json.

    python3 bench/lordba_compile.py [--time]
On the CPU it runs in the interpreter with Dynamo's aot_eager backend (a check of the script:
expect the interpreter failure described above).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from harness import metadata, parser, stamp, write_json

TOKENS = (64, 96, 256)


def _pair(kind: str, train: bool, device: str):
    import torch
    from torch import nn

    from loka.lordba import Fp8WeightOnlyLinear, LoRDBAConfig, LoRDBALinear
    from loka.lordba.testing import trained_like

    made = []
    for _ in range(2):
        torch.manual_seed(0)
        base = nn.Linear(512, 384, device=device, dtype=torch.bfloat16).requires_grad_(False)
        if kind == "fp8":
            base = Fp8WeightOnlyLinear.from_linear(base)
        config = LoRDBAConfig(rank=16, scaling=0.5, backend="triton")
        made.append(trained_like(LoRDBALinear(base, config), 0).requires_grad_(train))
    return made


def check(kind: str, train: bool, device: str, backend: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_module, eager = _pair(kind, train, device)
    compiled = torch.compile(compiled_module, backend=backend, dynamic=True)
    out_err = grad_err = 0.0
    for tokens in TOKENS:
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(2, tokens, 512, device=device, dtype=torch.bfloat16, generator=gen)
        with torch.set_grad_enabled(train):
            got, want = compiled(x), eager(x)
            scale = want.float().abs().max().clamp_min(1e-6)
            out_err = max(out_err, float((got.float() - want.float()).abs().max() / scale))
            if train:
                got.float().square().sum().backward()
                want.float().square().sum().backward()
    zero_grads = []
    if train:
        named = dict(eager.named_parameters())
        for name, p in compiled_module.named_parameters():
            q = named[name]
            if p.grad is None or not p.grad.abs().sum() > 0:
                zero_grads.append(name)
                continue
            scale = q.grad.float().abs().max().clamp_min(1e-6)
            grad_err = max(grad_err, float((p.grad.float() - q.grad.float()).abs().max() / scale))
    breaks = sum(counters["graph_break"].values())
    return {"base": kind, "train": train, "backend": backend, "out_rel_err": out_err,
            "grad_rel_err": grad_err if train else None, "zero_grads": zero_grads,
            "graph_breaks": breaks, "break_reasons": list(counters["graph_break"])[:5],
            "unique_graphs": counters["stats"]["unique_graphs"]}  # fmt: skip


def timing(device: str, backend: str, tokens: int = 8192, width: int = 4096) -> dict:
    """ms per forward + backward (adapter trained, base frozen), eager vs compiled."""
    import statistics
    import time

    import torch
    from torch import nn

    from loka.lordba import LoRDBAConfig, LoRDBALinear
    from loka.lordba.testing import trained_like

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = nn.Linear(width, width, device=device, dtype=torch.bfloat16).requires_grad_(False)
    module = trained_like(LoRDBALinear(base, LoRDBAConfig(rank=16, backend="triton")), 0)
    variants = {"eager": module, "compiled": torch.compile(module, backend=backend)}
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(fn) -> None:
        fn(x).sum().backward()

    for fn in variants.values():
        for _ in range(3):
            step(fn)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                step(fn)
            sync()
            times[name].append((time.perf_counter() - t0) * 100.0)  # ms per step
    median = {name: statistics.median(v) for name, v in times.items()}
    return {"tokens": tokens, "width": width, "rank": 16, "median_ms": median, "raw_ms": times,
            "compiled_over_eager": median["compiled"] / median["eager"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--time", action="store_true", help="also time eager vs compiled training")
    p.add_argument("--no-checks", action="store_true", help="only the timing (with --time)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if gpu else "cpu"
    backend = "inductor" if gpu else "aot_eager"
    rows = []
    for kind in () if args.no_checks else ("plain", "fp8"):
        for train in (False, True):
            try:
                row = check(kind, train, device, backend)
            except Exception as exc:  # recorded: the question is whether it runs at all
                row = {"base": kind, "train": train, "backend": backend,
                       "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                       "trace": traceback.format_exc()[-4000:]}  # fmt: skip
            rows.append(row)
            brief = {k: v for k, v in row.items() if k not in ("trace", "break_reasons")}
            print(f"[lordba_compile] {brief}", flush=True)
    timed = {}
    if args.time:
        timed = timing(device, backend, *((8192, 4096) if gpu else (64, 64)))
        print(f"[lordba_compile] ms per training step: {timed['median_ms']} "
              f"(compiled / eager {timed['compiled_over_eager']:.3f})", flush=True)  # fmt: skip
    path = Path(args.out) / f"lordba_compile_{stamp()}.json"
    write_json(path, {"meta": metadata(device, compile_backend=backend), "rows": rows,
                      "timing": timed})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
