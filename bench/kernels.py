"""loka-kernels on the GPU: correctness first, then speed, side by side in one run.

Sections (each row of the CSV is one path at one shape; ratios are within the section):
- fwd:     quantize(x) + GEMM with a cached FP8 weight, per backend and granularity, against
           bf16 torch.mm, pre-quantized torch._scaled_mm (tensorwise, rowwise: the ceiling),
           compiled dynamic quantization + _scaled_mm, and torchao's dynamic FP8 (if present).
- gemm:    the GEMMs alone on the same pre-quantized operands: Triton FP8 vs cuBLAS/CUTLASS.
- lnfwd:   LayerNorm -> Linear, the site where quantization fuses into a pass that reads the
           activation anyway: norm_quantize + FP8 GEMM against LayerNorm + bf16 torch.mm, and
           against LayerNorm + a pre-quantized GEMM (quantization for free: the ceiling).
- norm:    fused LayerNorm/RMSNorm + rowwise quantization vs the norm alone, vs norm + a
           separate quantization, vs torch.compile of norm + quantization.
- bwd:     dgrad and wgrad with transpose-quantization of dY, against bf16.
- grouped: many small GEMMs in one launch vs a loop of GEMMs (and bmm).
Every path is first checked against a float64 reference (relative Frobenius error on a row
sample); a failing or unsupported path becomes an error row, never a crash.

    python bench/kernels.py --smoke          # CPU, Triton interpreter, tiny shapes, < 1 min
    python bench/kernels.py --quick          # GPU, a few shapes, ~1-2 min (heuristic tiles)
    python bench/kernels.py                  # GPU, the full grid, ~5 min
Results: kernels_<mode>_<utc time>.csv (raw rows), .json (metadata, aims, checks) in --out
(default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from harness import Budget, metadata, parser, rel_err, stamp, write_csv, write_json

FIELDS = [
    "section", "path", "backend", "recipe", "pass", "M", "K", "N",
    "t_ms", "t_graph_ms", "t_host_us", "tflops", "speedup_vs_bf16", "ratio", "ratio_to", "rel_err", "ok", "error",
]  # fmt: skip
LRM_KN = [(128, 128), (512, 512), (1024, 1024), (1024, 4096), (4096, 1024), (2048, 2048),
          (4096, 4096), (8192, 8192)]  # fmt: skip
ERR_BOUND = {"bf16": 1e-2, "e4m3": 0.08, "e5m2": 0.16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)  # --out, --budget-s (default: 60 smoke, 150 quick, 330 full)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU")
    mode.add_argument("--quick", action="store_true", help="a few GPU shapes, about a minute")
    p.add_argument("--sections", default="host,fwd,gemm,lnfwd,norm,bwd,grouped",
                   help="any of host,tune,fwd,gemm,lnfwd,norm,bwd,grouped (tune: tile sweeps)")  # fmt: skip
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    p.add_argument("--M", help="comma-separated batch sizes replacing the mode's (full/quick)")
    p.add_argument("--KN", help="comma-separated KxN pairs replacing the mode's, e.g. 1024x4096")
    return p.parse_args(argv)


def mode_of(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


# Set by main() from the command line; importing the script runs nothing.
ARGS = parse_args([])
MODE = "full"
BUDGET = Budget(None)

import torch  # noqa: E402

if not torch.cuda.is_available():  # only --smoke runs on a CPU: in Triton's interpreter,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before any @triton.jit is created

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from loka.kernels import (  # noqa: E402
    fp8_gemm,
    launch,
    norm_quantize,
    registry,
    tuning,
)
from loka.kernels.fp8_gemm_tma import triton_fp8_mm_tma  # noqa: E402
from loka.kernels.grouped_gemm import loop_grouped_mm, triton_grouped_mm  # noqa: E402
from loka.kernels.mm import fp8_mm  # noqa: E402
from loka.kernels.quantization import quantize_reference, quantize_with  # noqa: E402
from loka.kernels.testing import assert_same_fp8  # noqa: E402
from loka.kernels.transpose_quantization import quantize_transpose_with  # noqa: E402
from loka.schema import QuantConfig, Recipe  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
ROWS: list[dict] = []
CHECKS: list[dict] = []
DEADLINE = [math.inf]  # end of the current section's share of the budget (BUDGET.elapsed())
SECTION_SHARE = {"tune": 0.5, "host": 0.06, "fwd": 0.17, "lnfwd": 0.05, "norm": 0.04, "bwd": 0.12,
                 "grouped": 0.06}  # fmt: skip


def shapes() -> dict:
    chosen = _mode_shapes()
    if ARGS.M:
        chosen["M"] = [int(m) for m in ARGS.M.split(",")]
    if ARGS.KN:
        chosen["KN"] = [tuple(int(v) for v in kn.split("x")) for kn in ARGS.KN.split(",")]
    return chosen


def _mode_shapes() -> dict:
    if MODE == "smoke":
        return {"M": [32], "KN": [(128, 144)], "norm_N": [128], "grouped": [(3, 32, 64, 48)],
                "host": [(32, 128)]}  # fmt: skip
    if MODE == "quick":
        return {"M": [8192], "KN": [(1024, 4096), (4096, 4096)], "norm_N": [1024],
                "grouped": [(32, 16384, 128, 128)], "host": [(8192, 1024), (256, 1024)]}  # fmt: skip
    # The most telling batch sizes first: past the budget, later shapes are skipped.
    return {"M": [8192, 32768, 2048, 131072], "KN": LRM_KN, "norm_N": [128, 512, 1024, 4096, 8192],
            "grouped": [(32, 16384, 128, 128), (8, 32768, 512, 512), (64, 4096, 128, 256)],
            "host": [(8192, 1024), (256, 1024)]}  # fmt: skip


# ---------------------------------------------------------------------------------------- timing
def timed(fn: Callable[[], object], small: bool) -> tuple[float, float]:
    """(median eager ms, median CUDA-graph ms or NaN). Eager includes launch overheads."""
    if not GPU:  # smoke run: one call proves the path works; its time means little
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, math.nan
    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    t = triton.testing.do_bench(
        fn, warmup=10, rep=40 if MODE == "full" else 25, return_mode="median"
    )
    tg = math.nan
    if small:
        try:
            tg = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
        except Exception:  # not capturable (host-to-device copies): eager only
            torch.cuda.synchronize()
    return t, tg


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Median host time of one call: the Python and launch work, not the GPU's. The queue is
    drained every 20 calls so that a full launch queue never blocks the timed call."""
    times = []
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def record(section: str, path: str, fn: Callable[[], object], *, backend="", recipe="bf16",
           pass_="fwd", M=0, K=0, N=0, flops=0.0, check: Callable[[], float] | None = None,
           bound: float | None = None) -> dict:  # fmt: skip
    """Check `fn` (if `check`), time it, append a row; any exception becomes an error row."""
    row = {"section": section, "path": path, "backend": backend, "recipe": recipe, "pass": pass_,
           "M": M, "K": K, "N": N, "ok": True, "error": ""}  # fmt: skip
    if BUDGET.elapsed() > DEADLINE[0]:
        row["error"] = "skipped: past this section's share of --budget-s"
        ROWS.append(row)
        return row
    try:
        if check is not None:
            err = check()
            row["rel_err"] = err
            row["ok"] = bool(err <= (bound if bound is not None else ERR_BOUND["bf16"]))
        small = M * max(K, N, 1) <= 8192 * 1024
        t, tg = timed(fn, small)
        row.update(t_ms=t, t_graph_ms=tg, tflops=flops / (t * 1e-3) / 1e12 if flops else math.nan)
        if GPU:
            row["t_host_us"] = host_us(fn)
    except Exception as exc:  # recorded, never fatal
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        if GPU:
            torch.cuda.synchronize()
    ROWS.append(row)
    return row


def sample_rows(M: int) -> slice:
    return slice(0, min(M, 512))


# ------------------------------------------------------------------------------- fwd and gemm
def compiled_dynamic_rowwise() -> Callable:
    """What torchao does: rowwise dynamic quantization of x, then _scaled_mm, compiled."""

    def fwd(x, w_fp8, w_inv):
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
        scale = 448.0 / amax
        xq = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, w_fp8.t(), scale_a=1.0 / scale, scale_b=w_inv,
                                out_dtype=torch.bfloat16)  # fmt: skip

    return torch.compile(fwd)


def torchao_linear(K: int, N: int, w: torch.Tensor) -> Callable | None:
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
    except Exception:
        return None
    lin = torch.nn.Linear(K, N, bias=False, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return torch.compile(lin)


FWD_RECIPES = [("tensor", None, None), ("row", None, None), ("block", (1, 128), (128, 128))]


def bench_fwd_and_gemm(M: int, K: int, N: int, compiled: Callable | None) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(M + K + N)
    x = torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16)
    rows = sample_rows(M)
    ref = x[rows].double() @ w.double().T
    flops = 2.0 * M * K * N
    shape = {"M": M, "K": K, "N": N, "flops": flops}

    def err_of(out_fn):
        return lambda: rel_err(out_fn()[rows], ref)

    mm = lambda: torch.mm(x, w.t())  # noqa: E731
    record("fwd", "bf16 torch.mm", mm, backend="torch.mm", check=err_of(mm), **shape)

    # Pre-quantized operands (the ceiling): raw torch._scaled_mm, as in the anchors.
    q = {gran: (quantize_with(x, QuantConfig("e4m3", gran, ab)), quantize_with(w, QuantConfig("e4m3", gran, bb)))
         for gran, ab, bb in FWD_RECIPES}  # fmt: skip
    for gran in ("tensor", "row") if GPU else ("tensor",):  # rowwise _scaled_mm needs CUDA
        qx, qw = q[gran]
        sa, sb = (
            (qx.inv_scale, qw.inv_scale)
            if gran == "tensor"
            else (qx.inv_scale[:, None], qw.inv_scale[None, :])
        )
        raw = lambda qx=qx, qw=qw, sa=sa, sb=sb: torch._scaled_mm(  # noqa: E731
            qx.data, qw.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
        )
        record("gemm", f"prequant scaled_mm {gran}", raw, backend="torch._scaled_mm",
               recipe=f"e4m3:e4m3/{gran}", check=err_of(raw), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip

    if compiled is not None:
        qw_row = q["row"][1]
        torch._dynamo.mark_dynamic(x, 0)  # one compile per (K, N), any M
        dyn = lambda: compiled(x, qw_row.data, qw_row.inv_scale[None, :])  # noqa: E731
        record("fwd", "compiled dynquant + scaled_mm row", dyn, backend="torch.compile",
               recipe="e4m3:e4m3/row", check=err_of(dyn), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
    torchao_shapes = {
        (8192, 1024, 4096),
        (8192, 4096, 1024),
        (8192, 4096, 4096),
        (32768, 4096, 4096),
    }
    if compiled is not None and (MODE != "full" or (M, K, N) in torchao_shapes):
        ao = torchao_linear(K, N, w)
        if ao is not None:
            run = lambda: ao(x)  # noqa: E731
            record("fwd", "torchao dynamic fp8 row (compiled)", run, backend="torchao",
                   recipe="e4m3:e4m3/row", check=err_of(run), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip

    for gran, ab, _ in FWD_RECIPES:
        cfg = QuantConfig("e4m3", gran, ab)
        qw = q[gran][1]
        recipe = Recipe("e4m3", "e4m3", gran)
        quant = lambda cfg=cfg: quantize_with(x, cfg)  # noqa: E731
        record("fwd", f"quantize x {gran}", quant, backend="loka.quantize",
               recipe=f"e4m3/{gran}", M=M, K=K, N=0)  # fmt: skip
        for backend in registry.backends("mm"):
            if backend.runs_bf16 or (GPU and backend.unavailable_reason(DEVICE)):
                continue
            if not GPU and not backend.triton:
                continue
            reason = backend.supports(recipe, M, K, N)
            if reason is not None:
                continue
            if not backend.name.endswith(".fast"):  # fast accumulation: timed in "gemm" only
                path = lambda b=backend, cfg=cfg, qw=qw: b.run(quantize_with(x, cfg), qw)  # noqa: E731
                record("fwd", f"ours quantize + {backend.name} {gran}", path, backend=backend.name,
                       recipe=str(f"e4m3:e4m3/{gran}"), check=err_of(path), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
            qx = q[gran][0]
            alone = lambda b=backend, qx=qx, qw=qw: b.run(qx, qw)  # noqa: E731
            record("gemm", f"{backend.name} {gran}", alone, backend=backend.name,
                   recipe=f"e4m3:e4m3/{gran}", check=err_of(alone), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip


# ------------------------------------------------------------------- LayerNorm -> Linear fwd
def compiled_ln_linear() -> Callable:
    """torch.compile of LayerNorm + rowwise quantization + _scaled_mm (Inductor fuses the first two)."""

    def fwd(x, ln_w, ln_b, w_fp8, w_inv):
        y = F.layer_norm(x, (x.shape[1],), ln_w, ln_b, 1e-5).float()
        scale = 448.0 / y.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        yq = (y * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            yq, w_fp8.t(), scale_a=1.0 / scale, scale_b=w_inv, out_dtype=torch.bfloat16
        )

    return torch.compile(fwd)


def bench_ln_linear(M: int, K: int, N: int, compiled: Callable | None) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(5 * M + K + N)
    x = (torch.randn(M, K, device=DEVICE, generator=g) * 2 + 0.5).to(torch.bfloat16)
    ln_w = (torch.rand(K, device=DEVICE, generator=g) + 0.5).to(torch.bfloat16)
    ln_b = (torch.randn(K, device=DEVICE, generator=g) * 0.1).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16)
    rows = sample_rows(M)
    ref = F.layer_norm(x[rows].double(), (K,), ln_w.double(), ln_b.double(), 1e-5) @ w.double().T
    shape = {"M": M, "K": K, "N": N, "flops": 2.0 * M * K * N}

    def ln():
        return F.layer_norm(x, (K,), ln_w, ln_b, 1e-5)

    def check(run):
        return lambda: rel_err(run()[rows], ref)

    base = lambda: torch.mm(ln(), w.t())  # noqa: E731
    record("lnfwd", "bf16 layer_norm + mm", base, backend="torch", check=check(base), **shape)
    row = QuantConfig("e4m3", "row")
    qw = quantize_with(w, row)
    qy = quantize_with(ln(), row)
    scale_a, scale_b = qy.inv_scale[:, None], qw.inv_scale[None, :]

    def ceiling():  # LayerNorm, then a GEMM on already-quantized rows: quantization for free
        ln()
        return torch._scaled_mm(
            qy.data, qw.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
        )

    if GPU:
        record("lnfwd", "layer_norm + prequant scaled_mm row", ceiling, backend="torch._scaled_mm",
               recipe="e4m3:e4m3/row", check=check(ceiling), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
    for backend in registry.backends("mm"):
        if backend.name.endswith(".fast") or backend.runs_bf16:
            continue
        if (GPU and backend.unavailable_reason(DEVICE)) or (not GPU and not backend.triton):
            continue
        if backend.supports(Recipe("e4m3", "e4m3", "row"), M, K, N) is not None:
            continue
        fused = lambda b=backend: b.run(norm_quantize(x, ln_w, ln_b, kind="layernorm").q, qw)  # noqa: E731
        record("lnfwd", f"ours layernorm+quantize + {backend.name} row", fused, backend=backend.name,
               recipe="e4m3:e4m3/row", check=check(fused), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
    if compiled is not None:
        torch._dynamo.mark_dynamic(x, 0)
        comp = lambda: compiled(x, ln_w, ln_b, qw.data, scale_b)  # noqa: E731
        record("lnfwd", "compiled layernorm+quant + scaled_mm row", comp, backend="torch.compile",
               recipe="e4m3:e4m3/row", check=check(comp), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip


# ------------------------------------------------------------------------------------- norms
def compiled_norm_quant() -> Callable:
    def fwd(x, w, b):
        y = F.layer_norm(x, (x.shape[1],), w, b, 1e-5).float()
        amax = y.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scale = 448.0 / amax
        return (y * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), 1.0 / scale

    return torch.compile(fwd)


def bench_norm(M: int, N: int, compiled: Callable | None) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(M + N)
    x = (torch.randn(M, N, device=DEVICE, generator=g) * 2 + 0.5).to(torch.bfloat16)
    w = (torch.rand(N, device=DEVICE, generator=g) + 0.5).to(torch.bfloat16)
    b = (torch.randn(N, device=DEVICE, generator=g) * 0.1).to(torch.bfloat16)
    rows = sample_rows(M)
    ref = F.layer_norm(x[rows].double(), (N,), w.double(), b.double(), 1e-5)
    shape = {"M": M, "K": N, "N": 0, "pass_": "fwd"}
    ln = lambda: F.layer_norm(x, (N,), w, b, 1e-5)  # noqa: E731
    record(
        "norm", "F.layer_norm", ln, backend="torch", check=lambda: rel_err(ln()[rows], ref), **shape
    )
    fused = lambda: norm_quantize(x, w, b, kind="layernorm")  # noqa: E731
    record("norm", "ours layernorm+quantize", fused, backend="loka.norm_quantize", recipe="e4m3/row",
           check=lambda: rel_err(fused().q.dequantize()[rows], ref), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
    both = lambda: norm_quantize(x, w, b, kind="layernorm", return_normed=True)  # noqa: E731
    record("norm", "ours layernorm+quantize (+bf16 out)", both, backend="loka.norm_quantize",
           recipe="e4m3/row", check=lambda: rel_err(both().normed[rows], ref), **shape)  # fmt: skip
    row_cfg = QuantConfig("e4m3", "row")
    sep = lambda: quantize_with(ln(), row_cfg)  # noqa: E731
    record("norm", "F.layer_norm + ours quantize", sep, backend="torch+loka.quantize",
           recipe="e4m3/row", **shape)  # fmt: skip
    if compiled is not None:
        torch._dynamo.mark_dynamic(x, 0)
        comp = lambda: compiled(x, w, b)  # noqa: E731
        record("norm", "compiled layernorm+quantize", comp, backend="torch.compile",
               recipe="e4m3/row", **shape)  # fmt: skip
    rms = lambda: F.rms_norm(x, (N,), w, 1e-5)  # noqa: E731
    record("norm", "F.rms_norm", rms, backend="torch", **shape)
    rq = lambda: norm_quantize(x, w, None, kind="rmsnorm")  # noqa: E731
    record(
        "norm",
        "ours rmsnorm+quantize",
        rq,
        backend="loka.norm_quantize",
        recipe="e4m3/row",
        **shape,
    )


# -------------------------------------------------------------------------------------- bwd
def bench_bwd(M: int, K: int, N: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(3 * M + K + N)
    x = torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16)
    dy = torch.randn(M, N, device=DEVICE, generator=g).to(torch.bfloat16)
    r = sample_rows(M)
    rk = slice(0, min(N, 512))
    dgrad_ref = dy[r].double() @ w.double()
    wgrad_ref = dy[:, rk].double().T @ x.double()
    base = {"M": M, "K": K, "N": N, "flops": 2.0 * M * K * N}
    dgrad = lambda: torch.mm(dy, w)  # noqa: E731
    wgrad = lambda: torch.mm(dy.t(), x)  # noqa: E731
    record("bwd", "bf16 dgrad", dgrad, backend="torch.mm", pass_="dgrad",
           check=lambda: rel_err(dgrad()[r], dgrad_ref), **base)  # fmt: skip
    record("bwd", "bf16 wgrad", wgrad, backend="torch.mm", pass_="wgrad",
           check=lambda: rel_err(wgrad()[rk], wgrad_ref), **base)  # fmt: skip
    record("bwd", "bf16 dgrad+wgrad", lambda: (dgrad(), wgrad()), backend="torch.mm",
           pass_="dgrad+wgrad", M=M, K=K, N=N, flops=4.0 * M * K * N)  # fmt: skip
    for gran, act_block, w_block in (("row", None, None), ("block", (1, 128), (128, 128))):
        _bench_bwd_recipe(x, w, dy, gran, act_block, w_block, (r, dgrad_ref), (rk, wgrad_ref), base)


def _bench_bwd_recipe(x, w, dy, gran, act_block, w_block, dgrad_check, wgrad_check, base) -> None:
    """dgrad and wgrad of one granularity: dY in e5m2, x and W in e4m3, every FP8 backend."""
    M, K, N = base["M"], base["K"], base["N"]
    (r, dgrad_ref), (rk, wgrad_ref) = dgrad_check, wgrad_check
    g_cfg = QuantConfig("e5m2", gran, act_block)
    x_cfg = QuantConfig("e4m3", gran, act_block)
    _, qxt = quantize_transpose_with(x, x_cfg)  # saved by the forward
    _, qwt = quantize_transpose_with(w, QuantConfig("e4m3", gran, w_block))  # cached weight
    recipe = f"e5m2:e4m3/{gran}"
    qt = lambda: quantize_transpose_with(dy, g_cfg)  # noqa: E731
    record("bwd", f"transpose-quantize dY {gran}", qt, backend="loka.quantize_transpose",
           recipe=f"e5m2/{gran}", pass_="dgrad+wgrad", M=M, K=0, N=N)  # fmt: skip
    if gran == "row":
        sep = lambda: (quantize_with(dy, g_cfg), quantize_with(dy.t().contiguous(), g_cfg))  # noqa: E731
        record("bwd", "separate: quantize dY + transpose + quantize", sep, backend="loka.quantize",
               recipe=f"e5m2/{gran}", pass_="dgrad+wgrad", M=M, K=0, N=N)  # fmt: skip
    qdy, qdyt = qt()
    for backend in registry.backends("mm"):
        if backend.runs_bf16 or (GPU and backend.unavailable_reason(DEVICE)):
            continue
        if not GPU and not backend.triton:
            continue
        if backend.name.endswith(".fast"):  # gradients keep float32 accumulation
            continue
        spec = Recipe("e5m2", "e4m3", gran)
        if backend.supports(spec, M, K, N, "dgrad") or backend.supports(spec, M, K, N, "wgrad"):
            continue
        d = lambda b=backend: b.run(qdy, qwt)  # noqa: E731
        wg = lambda b=backend: b.run(qdyt, qxt)  # noqa: E731
        record("bwd", f"{backend.name} dgrad {gran}", d, backend=backend.name, recipe=recipe,
               pass_="dgrad", check=lambda d=d: rel_err(d()[r], dgrad_ref), bound=ERR_BOUND["e5m2"], **base)  # fmt: skip
        record("bwd", f"{backend.name} wgrad {gran}", wg, backend=backend.name, recipe=recipe,
               pass_="wgrad", check=lambda wg=wg: rel_err(wg()[rk], wgrad_ref), bound=ERR_BOUND["e5m2"], **base)  # fmt: skip

        def total(b=backend):
            a, at = quantize_transpose_with(dy, g_cfg)
            return b.run(a, qwt), b.run(at, qxt)

        record("bwd", f"ours transpose-quantize + {backend.name} dgrad+wgrad {gran}", total,
               backend=backend.name, recipe=recipe, pass_="dgrad+wgrad", M=M, K=K, N=N,
               flops=4.0 * M * K * N)  # fmt: skip


# ---------------------------------------------------------------------------------- grouped
def bench_grouped(G: int, M: int, K: int, N: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(G * M + K + N)
    a = [torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(G)]
    b = [torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(G)]
    refs = [ai[: min(M, 256)].double() @ bi.double().T for ai, bi in zip(a, b, strict=True)]

    def err(outs):
        return max(rel_err(o[: min(M, 256)], rf) for o, rf in zip(outs, refs, strict=True))

    shape = {"M": M, "K": K, "N": N, "flops": 2.0 * G * M * K * N}
    label = f"G={G}"
    loop = lambda: loop_grouped_mm(a, b)  # noqa: E731
    record("grouped", f"bf16 loop of F.linear {label}", loop, backend="torch.loop",
           check=lambda: err(loop()), **shape)  # fmt: skip
    a3, b3 = torch.stack(a), torch.stack(b)
    bmm = lambda: torch.bmm(a3, b3.transpose(1, 2))  # noqa: E731
    record(
        "grouped",
        f"bf16 torch.bmm {label}",
        bmm,
        backend="torch.bmm",
        check=lambda: err(list(bmm())),
        **shape,
    )
    a_views, b_views = list(a3.unbind(0)), list(b3.unbind(0))
    stacked = lambda: triton_grouped_mm(a_views, b_views)  # noqa: E731
    record("grouped", f"triton.grouped bf16, views of one buffer (bmm) {label}", stacked,
           backend="triton.grouped", check=lambda: err(stacked()), **shape)  # fmt: skip
    grouped = lambda: triton_grouped_mm(a, b)  # noqa: E731
    record("grouped", f"triton.grouped bf16 {label}", grouped, backend="triton.grouped",
           check=lambda: err(grouped()), **shape)  # fmt: skip
    cfg = QuantConfig("e4m3", "row")
    qa = [quantize_with(t, cfg) for t in a]
    qb = [quantize_with(t, cfg) for t in b]
    gq = lambda: triton_grouped_mm(qa, qb)  # noqa: E731
    record("grouped", f"triton.grouped fp8 row (prequant) {label}", gq, backend="triton.grouped",
           recipe="e4m3:e4m3/row", check=lambda: err(gq()), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip
    if GPU:
        lq = lambda: loop_grouped_mm(qa, qb)  # noqa: E731
        record("grouped", f"loop of scaled_mm fp8 row (prequant) {label}", lq,
               backend="torch.loop.scaled_mm", recipe="e4m3:e4m3/row",
               check=lambda: err(lq()), bound=ERR_BOUND["e4m3"], **shape)  # fmt: skip


# --------------------------------------------------------------------------------- checks
def byte_exact_checks() -> None:
    """The hardware FP8 casts must reproduce the torch reference byte for byte: two inputs
    per configuration (the second call runs the cached launch plan), and an unaligned view
    after an aligned one of the same shape and strides (a different specialization)."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    spread = torch.logspace(-3, 3, 300, device=DEVICE)[:, None]
    wide = (torch.randn(300, 1001, device=DEVICE, generator=g) * spread).to(torch.bfloat16)
    wide[5, 7], wide[6, 1] = float("nan"), float("inf")
    inputs = [wide[:, :1000], wide[:, 1:]]  # 16-byte aligned, then not
    inputs.append((torch.randn(300, 1000, device=DEVICE, generator=g) * spread).to(torch.bfloat16))
    for fmt in ("e4m3", "e5m2"):
        for gran, blk in (
            ("tensor", None),
            ("row", None),
            ("block", (1, 128)),
            ("block", (128, 128)),
        ):
            for pow2 in (False, True):
                cfg = QuantConfig(fmt, gran, blk, pow2)
                name = f"quantize {fmt} {gran} {blk} pow2={pow2}"
                try:
                    for x in inputs:
                        assert_same_fp8(quantize_with(x, cfg), quantize_reference(x, cfg))
                        qt, qtt = quantize_transpose_with(x, cfg)
                        assert_same_fp8(qt, quantize_reference(x, cfg))
                        assert_same_fp8(qtt, quantize_reference(x.t().contiguous(), cfg))
                    CHECKS.append({"check": name + " (+transpose, 3 inputs)", "ok": True})
                except Exception as exc:
                    CHECKS.append(
                        {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
                    )
    hist = torch.tensor([3.0], device=DEVICE)
    try:  # delayed tensorwise scaling: scale from the history, amax measured
        for x in inputs:
            cfg = QuantConfig("e4m3", "tensor")
            assert_same_fp8(quantize_with(x, cfg, hist), quantize_reference(x, cfg, hist))
            qt, qtt = quantize_transpose_with(x, cfg, hist)
            assert_same_fp8(qtt, quantize_reference(x.t().contiguous(), cfg, hist))
        CHECKS.append({"check": "delayed tensor amax (+transpose, 3 inputs)", "ok": True})
    except Exception as exc:
        CHECKS.append({"check": "delayed tensor amax", "ok": False, "error": f"{exc}"[:400]})


# ------------------------------------------------------------------------------ host overhead
@triton.jit
def _store_one_kernel(x_ptr):
    tl.store(x_ptr, 1.0)


def bench_host(M: int, K: int) -> None:
    """Host time per call (t_host_us) of each entry point, with launch plans cached (ours)
    and with every launch through Triton's own path (`tuning.launch_cache(False)`), against
    torch ops and the floor: one empty Triton launch each way."""
    g = torch.Generator(device=DEVICE).manual_seed(M + K)
    x = torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16)
    w = (torch.rand(K, device=DEVICE, generator=g) + 0.5).to(torch.bfloat16)
    bias = torch.zeros(K, device=DEVICE, dtype=torch.bfloat16)
    qw = quantize_with(torch.randn(1024, K, device=DEVICE, generator=g).to(torch.bfloat16),
                       QuantConfig("e4m3", "row"))  # fmt: skip
    one = torch.zeros(1, device=DEVICE)
    floor = launch.Launcher(_store_one_kernel)
    shape = {"M": M, "K": K, "N": 0}
    record("host", "torch.empty_like", lambda: torch.empty_like(x), backend="torch", **shape)
    record("host", "F.layer_norm", lambda: F.layer_norm(x, (K,), w, bias), backend="torch", **shape)
    record("host", "F.rms_norm", lambda: F.rms_norm(x, (K,), w), backend="torch", **shape)
    record("host", "empty Triton launch (Triton's path)", lambda: _store_one_kernel[(1,)](one),
           backend="triton", **shape)  # fmt: skip
    record("host", "empty Triton launch (cached plan)", lambda: floor(("one",), (1,), (one,), {}),
           backend="loka.launch", **shape)  # fmt: skip
    row, tensor = QuantConfig("e4m3", "row"), QuantConfig("e4m3", "tensor")
    block, grad_row = QuantConfig("e4m3", "block", (1, 128)), QuantConfig("e5m2", "row")
    grad_block = QuantConfig("e5m2", "block", (1, 128))
    paths = {  # configs made once, as modules keep them
        "quantize row": lambda: quantize_with(x, row),
        "quantize tensor": lambda: quantize_with(x, tensor),
        "quantize block": lambda: quantize_with(x, block),
        "quantize_transpose row": lambda: quantize_transpose_with(x, grad_row),
        "quantize_transpose block": lambda: quantize_transpose_with(x, grad_block),
        "norm_quantize layernorm": lambda: norm_quantize(x, w, bias, kind="layernorm"),
        "norm_quantize rmsnorm": lambda: norm_quantize(x, w, None, kind="rmsnorm"),
    }
    qx = quantize_with(x, QuantConfig("e4m3", "row"))
    paths["triton_fp8_mm row (N=1024)"] = lambda: fp8_gemm.triton_fp8_mm(qx, qw)
    paths["fp8_mm default backend row (N=1024)"] = lambda: fp8_mm(qx, qw)
    for cached in (True, False):
        suffix = "" if cached else " [Triton's launch path]"
        with tuning.launch_cache(cached):
            for name, fn in paths.items():
                record("host", name + suffix, fn, backend="loka.kernels", **shape)
    sa, sb = qx.inv_scale[:, None], qw.inv_scale[None, :]
    raw = lambda: torch._scaled_mm(qx.data, qw.data.t(), scale_a=sa, scale_b=sb,  # noqa: E731
                                   out_dtype=torch.bfloat16)  # fmt: skip
    if GPU:
        record("host", "torch._scaled_mm row (N=1024)", raw, backend="torch", **shape)


# ----------------------------------------------------------------------------------- tile sweeps
GEMM_TILES = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); spilling ones left out (ptxas)
    "plain": [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 8, 5),
              (256, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4)],
    "fast": [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
             (256, 128, 128, 8, 3)],
    "block": [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (64, 128, 128, 4, 4)],
    "tma": [(128, 128, 128, 8, 4), (128, 128, 128, 8, 3), (256, 128, 128, 8, 3)],
    "tma_fast": [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3)],
}  # fmt: skip
ROW_TILES = [{"elements": e, "warps": w} for e, w in
             ((4096, None), (8192, None), (16384, None), (8192, 16), (16384, 16), (4096, 4))]  # fmt: skip
TRANSPOSE_TILES = [((64, 64), 4), ((32, 128), 4), ((64, 128), 8), ((128, 64), 4),
                   ((128, 128), 8), ((128, 128), 16)]  # fmt: skip
AMAX_TILES = [(128, 256), (64, 256), (64, 128), (256, 128)]
GROUPED_TILES = [(128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3),
                 (128, 128, 128, 8, 3)]  # fmt: skip
TUNED: dict = {}  # the defaults the sweep chose and applied, for the metadata


def tune_shapes(mode: str) -> dict:
    """Shapes of the sweeps; the smoke run walks two variants of each at tiny shapes on CPU."""
    smoke = mode == "smoke"
    return {
        "rows": [(32, 128), (16, 256)] if smoke else [(8192, 1024), (8192, 4096)],
        "transpose": [(64, 128), (32, 64)] if smoke else [(8192, 4096), (8192, 1024)],
        "gemm": [(32, 128, 64)] if smoke else [(8192, 4096, 4096), (8192, 1024, 4096)],
        "grouped": (2, 32, 128, 64) if smoke else (32, 16384, 128, 128),
    }


def _variants(variants: list) -> list:
    return variants[:2] if MODE == "smoke" else variants


def _tile_dict(t: tuple) -> dict:
    bm, bn, bk, w, st = t
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w,
            "num_stages": st}  # fmt: skip


def _gpu_ms(row: dict) -> float | None:
    """The GPU time of a row: CUDA-graph time where measured, else eager. Eager times of
    small shapes carry the host's time, which varies by machine and moment (seen: 70 vs
    110 us for one call), and must not pick tiles."""
    tg = row.get("t_graph_ms")
    return tg if tg is not None and not math.isnan(tg) else row.get("t_ms")


def _fastest(rows: list[tuple[object, list[dict]]]) -> object:
    """The variant whose rows (one per shape) are all correct with the least total GPU time
    relative to the best at each shape; None if none is."""
    best_at: dict = {}
    for _, rs in rows:
        for i, r in enumerate(rs):
            if r["ok"] and _gpu_ms(r):
                best_at[i] = min(best_at.get(i, math.inf), _gpu_ms(r))
    scored = [(sum(_gpu_ms(r) / best_at[i] for i, r in enumerate(rs)), variant)
              for variant, rs in rows
              if rs and all(r["ok"] and _gpu_ms(r) for r in rs)]  # fmt: skip
    return min(scored, key=lambda sv: sv[0])[1] if scored else None


def bench_tune() -> None:
    """Tile sweeps, each variant checked then timed at the quick shapes; the fastest correct
    variant becomes the default for the rest of the run (and is recorded in TUNED)."""
    tune_quantize_rows()
    tune_transpose()
    tune_gemms()
    tune_grouped()
    print("tuned defaults:", json.dumps(TUNED, default=str), flush=True)


def tune_quantize_rows() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(21)
    xs = [
        torch.randn(*rc, device=DEVICE, generator=g).to(torch.bfloat16)
        for rc in tune_shapes(MODE)["rows"]
    ]
    cfg = QuantConfig("e4m3", "row")
    wants = [quantize_reference(x, cfg) for x in xs]
    results = []
    for tile in _variants(ROW_TILES):
        tuning.set_tiles(quantize_rows=tile)
        rs = []
        for x, want in zip(xs, wants, strict=True):
            fn = lambda x=x: quantize_with(x, cfg)  # noqa: E731

            def exact(fn=fn, want=want):
                fn()
                assert_same_fp8(fn(), want)
                return 0.0

            rs.append(record("tune", f"quantize row {tile}", fn, backend="loka.quantize",
                             recipe="e4m3/row", check=exact, M=x.shape[0], K=x.shape[1]))  # fmt: skip
        results.append((tile, rs))
    tuning.set_tiles(quantize_rows=_fastest(results) or ROW_TILES[0])
    TUNED["quantize_rows"] = tuning.tiles()["quantize_rows"]


def tune_transpose() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(22)
    dys = [
        torch.randn(*rc, device=DEVICE, generator=g).to(torch.bfloat16)
        for rc in tune_shapes(MODE)["transpose"]
    ]

    def sweep(label, cfg, variants, apply):
        wants = [
            (quantize_reference(d, cfg), quantize_reference(d.t().contiguous(), cfg)) for d in dys
        ]
        results = []
        for variant in _variants(variants):
            tuning.set_tiles(transpose=apply(variant))
            rs = []
            for d, (want_q, want_qt) in zip(dys, wants, strict=True):
                fn = lambda d=d: quantize_transpose_with(d, cfg)  # noqa: E731

                def exact(fn=fn, want_q=want_q, want_qt=want_qt):
                    fn()
                    q, qt = fn()
                    assert_same_fp8(q, want_q)
                    assert_same_fp8(qt, want_qt)
                    return 0.0

                rs.append(record("tune", f"transpose-quantize {label} {variant}", fn,
                                 backend="loka.quantize_transpose", recipe=f"{cfg.fmt}/{label}",
                                 check=exact, M=d.shape[0], K=0, N=d.shape[1]))  # fmt: skip
            results.append((variant, rs))
        best = _fastest(results)
        tuning.set_tiles(transpose=apply(best if best is not None else variants[0]))

    row, block = QuantConfig("e5m2", "row"), QuantConfig("e5m2", "block", (1, 128))
    sweep("row", row, TRANSPOSE_TILES, lambda v: {"quantize": v[0], "warps": v[1]})
    sweep("row amax tile", row, AMAX_TILES, lambda v: {"amax": v})
    sweep("block", block, [8, 16], lambda v: {"block_warps": v})
    TUNED["transpose"] = tuning.tiles()["transpose"]


def tune_gemms() -> None:
    g = torch.Generator(device=DEVICE).manual_seed(23)
    cases = []
    for M, K, N in tune_shapes(MODE)["gemm"]:
        x = torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16)
        rows = sample_rows(M)
        ref = x[rows].double() @ w.double().T
        ops = {gran: (quantize_with(x, QuantConfig("e4m3", gran, blk)),
                      quantize_with(w, QuantConfig("e4m3", gran, wblk)))
               for gran, blk, wblk in (("row", None, None), ("block", (1, 128), (128, 128)))}  # fmt: skip
        ops["block 1x128"] = (
            ops["block"][0],
            quantize_with(w, QuantConfig("e4m3", "block", (1, 128))),
        )
        cases.append(((M, K, N), rows, ref, ops))

    def sweep(kind, tiles, gran, call):
        results = []
        for t in _variants(tiles):
            rs = []
            for (M, K, N), rows, ref, ops in cases:
                qa, qb = ops[gran]
                fn = lambda qa=qa, qb=qb, t=t: call(qa, qb, _tile_dict(t))  # noqa: E731
                check = lambda fn=fn, rows=rows, ref=ref: (fn(), rel_err(fn()[rows], ref))[1]  # noqa: E731
                rs.append(record("tune", f"{kind} {gran} {t}", fn, backend=kind, recipe=f"e4m3:e4m3/{gran}",
                                 check=check, bound=ERR_BOUND["e4m3"], M=M, K=K, N=N,
                                 flops=2.0 * M * K * N))  # fmt: skip
            results.append((t, rs))
        return _fastest(results)

    mm = fp8_gemm.triton_fp8_mm
    plain = sweep("triton.fp8", GEMM_TILES["plain"], "row", lambda a, b, t: mm(a, b, tile=t))
    fast = sweep("triton.fp8.fast", GEMM_TILES["fast"], "row",
                 lambda a, b, t: mm(a, b, tile=t, fast_accum=True))  # fmt: skip
    block = sweep("triton.fp8", GEMM_TILES["block"], "block", lambda a, b, t: mm(a, b, tile=t))
    # The 1x128 x 1x128 product of wgrad, with its scales read K-block-major or gathered.
    for transposed in (False, True):
        tuning.set_tiles(row_block_scales_transposed=transposed)
        sweep(f"triton.fp8 scales K-block-major={transposed}", [block or GEMM_TILES["block"][0]],
              "block 1x128", lambda a, b, t: mm(a, b, tile=t))  # fmt: skip
    tuning.set_tiles(row_block_scales_transposed=True)
    tma = sweep("triton.fp8.tma", GEMM_TILES["tma"], "row",
                lambda a, b, t: triton_fp8_mm_tma(a, b, tile=t))  # fmt: skip
    tma_fast = sweep("triton.fp8.tma.fast", GEMM_TILES["tma_fast"], "row",
                     lambda a, b, t: triton_fp8_mm_tma(a, b, tile=t, fast_accum=True))  # fmt: skip
    best_gemm = {"plain": plain, "fast": fast, "block": block}
    tuning.set_tiles(
        gemm={key: best for key, best in best_gemm.items() if best is not None},
        gemm_tma={key: best for key, best in ((False, tma), (True, tma_fast)) if best is not None},
    )
    TUNED["gemm"], TUNED["gemm_tma"] = tuning.tiles()["gemm"], tuning.tiles()["gemm_tma"]
    # The autotuner (full runs, users' default), through the cached-plan path on its 2nd call.
    autotune_env = os.environ.get("LOKA_KERNELS_AUTOTUNE")
    os.environ["LOKA_KERNELS_AUTOTUNE"] = "1"
    (M, K, N), rows, ref, ops = cases[0]
    auto = lambda: mm(*ops["row"])  # noqa: E731
    record("tune", "triton.fp8 row autotuned", auto, backend="triton.fp8", recipe="e4m3:e4m3/row",
           check=lambda: (auto(), rel_err(auto()[rows], ref))[1], bound=ERR_BOUND["e4m3"],
           M=M, K=K, N=N, flops=2.0 * M * K * N)  # fmt: skip
    os.environ.pop("LOKA_KERNELS_AUTOTUNE")
    if autotune_env is not None:
        os.environ["LOKA_KERNELS_AUTOTUNE"] = autotune_env


def tune_grouped() -> None:
    G, M, K, N = tune_shapes(MODE)["grouped"]
    g = torch.Generator(device=DEVICE).manual_seed(24)
    a = [torch.randn(M, K, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(G)]
    b = [torch.randn(N, K, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(G)]
    cfg = QuantConfig("e4m3", "row")
    qa, qb = [quantize_with(t, cfg) for t in a], [quantize_with(t, cfg) for t in b]
    refs = [ai[:256].double() @ bi.double().T for ai, bi in zip(a, b, strict=True)]

    def err(outs):
        return max(rel_err(o[:256], rf) for o, rf in zip(outs, refs, strict=True))

    shape = {"M": M, "K": K, "N": N, "flops": 2.0 * G * M * K * N}
    results = []
    for t in _variants(GROUPED_TILES):
        tuning.set_tiles(grouped=t)
        rs = []
        for label, (ga, gb), bound in (
            ("bf16", (a, b), ERR_BOUND["bf16"]),
            ("fp8 row", (qa, qb), ERR_BOUND["e4m3"]),
        ):
            fn = lambda ga=ga, gb=gb: triton_grouped_mm(ga, gb)  # noqa: E731
            rs.append(record("tune", f"triton.grouped {label} G={G} {t}", fn, backend="triton.grouped",
                             check=lambda fn=fn: err(fn()), bound=bound, **shape))  # fmt: skip
        results.append((t, rs))
    tuning.set_tiles(grouped=_fastest(results) or GROUPED_TILES[0])
    TUNED["grouped"] = tuning.tiles()["grouped"]


# -------------------------------------------------------------------------------- summary
def derive() -> None:
    """Speedups against bf16 and the section's ratio (vs the ceiling / the norm alone)."""

    def find(section, path, M, K, N, pass_="fwd"):
        for r in ROWS:
            if (r["section"], r["path"], r["M"], r["K"], r["N"], r["pass"]) == (
                section,
                path,
                M,
                K,
                N,
                pass_,
            ):
                return r.get("t_ms")
        return None

    for r in ROWS:
        t = r.get("t_ms")
        if t is None or not r["ok"]:
            continue
        M, K, N, s = r["M"], r["K"], r["N"], r["section"]
        if s in ("fwd", "gemm"):
            bf = find("fwd", "bf16 torch.mm", M, K, N)
            ceil = find("gemm", "prequant scaled_mm row", M, K, N)
            if bf and r["N"]:
                r["speedup_vs_bf16"] = bf / t
                if ceil:
                    r["ratio"], r["ratio_to"] = (
                        (bf / t) / (bf / ceil),
                        "share of prequant rowwise speedup",
                    )
            if s == "gemm" and r["backend"].startswith("triton.fp8"):
                cub = find("gemm", f"prequant scaled_mm {r['recipe'].split('/')[-1]}", M, K, N)
                if cub:
                    r["ratio"], r["ratio_to"] = cub / t, "cuBLAS/CUTLASS time / this time"
        elif s == "lnfwd":
            bf = find("lnfwd", "bf16 layer_norm + mm", M, K, N)
            ceil = find("lnfwd", "layer_norm + prequant scaled_mm row", M, K, N)
            if bf:
                r["speedup_vs_bf16"] = bf / t
                if ceil:
                    r["ratio"], r["ratio_to"] = (
                        (bf / t) / (bf / ceil),
                        "share of the free-quantization speedup",
                    )
        elif s == "norm":
            base = find("norm", "F.rms_norm" if "rms" in r["path"] else "F.layer_norm", M, K, N)
            if base:
                r["ratio"], r["ratio_to"] = t / base, "time / norm alone"
        elif s == "bwd":
            bf = find("bwd", f"bf16 {r['pass']}", M, K, N, r["pass"])
            if bf and r["K"]:
                r["speedup_vs_bf16"] = bf / t
        elif s == "grouped":
            loop = next((x["t_ms"] for x in ROWS if x["section"] == "grouped" and x["path"].startswith("bf16 loop")
                         and (x["M"], x["K"], x["N"]) == (M, K, N) and x.get("t_ms")), None)  # fmt: skip
            if loop:
                r["speedup_vs_bf16"] = loop / t


def aims() -> dict:
    """The issue's aims, evaluated on the rows: met or missed, by how much, where."""
    out = {}
    for section, prefix, name in (
        ("fwd", "ours quantize", "quantize + GEMM: share of pre-quantized rowwise speedup >= 0.90"),
        ("lnfwd", "ours layernorm+quantize", "LayerNorm+quantize + GEMM: share of free-quantization speedup >= 0.90"),
    ):  # fmt: skip
        best: dict = {}
        for r in ROWS:  # the best backend per shape, rowwise, K and N >= 2048
            if (r["section"] == section and r["path"].startswith(prefix) and r["recipe"].endswith("/row")
                    and r.get("ratio") and min(r["K"], r["N"]) >= 2048):  # fmt: skip
                key = (r["M"], r["K"], r["N"])
                if key not in best or r["ratio"] > best[key]["ratio"]:
                    best[key] = r
        if best:
            worst = min(best.values(), key=lambda r: r["ratio"])
            out[name + " (K,N>=2048, best backend)"] = {
                "met": sum(r["ratio"] >= 0.9 for r in best.values()),
                "of": len(best),
                "worst": {k: worst[k] for k in ("M", "K", "N", "path", "ratio")},
            }
    best_tri: dict = {}
    for r in ROWS:  # the best Triton kernel (plain or TMA, float32 accumulation) per shape
        if (
            r["section"] == "gemm"
            and r["backend"] in ("triton.fp8", "triton.fp8.tma")
            and r.get("ratio")
        ):
            key = (r["M"], r["K"], r["N"], r["recipe"])
            if key not in best_tri or r["ratio"] > best_tri[key]["ratio"]:
                best_tri[key] = r
    tri = list(best_tri.values())
    if tri:
        worst = min(tri, key=lambda r: r["ratio"])
        out["triton_gemm_vs_cublas>=0.90 (best of triton.fp8, triton.fp8.tma)"] = {
            "met": sum(r["ratio"] >= 0.9 for r in tri),
            "of": len(tri),
            "worst": {k: worst[k] for k in ("M", "K", "N", "recipe", "backend", "ratio")},
        }
    ln = [r for r in ROWS if r["path"] == "ours layernorm+quantize" and r.get("ratio")]
    if ln:
        worst = max(ln, key=lambda r: r["ratio"])
        out["fused_layernorm_quant<=1.10x_layernorm"] = {
            "met": sum(r["ratio"] <= 1.1 for r in ln),
            "of": len(ln),
            "worst": {k: worst[k] for k in ("M", "K", "ratio")},
        }
    return out


def fmt(v, digits=3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _t(path: str, M: int, K: int, N: int, pass_: str = "fwd") -> float | None:
    for r in ROWS:
        if (r["path"], r["M"], r["K"], r["N"], r["pass"]) == (path, M, K, N, pass_) and r["ok"]:
            return r.get("t_ms")
    return None


def _best(rows: list[dict], key: str = "speedup_vs_bf16") -> dict | None:
    rows = [r for r in rows if r["ok"] and r.get(key)]
    return max(rows, key=lambda r: r[key]) if rows else None


def print_summary(aim: dict) -> None:
    print(f"\n== loka-kernels bench ({MODE}) on {device_name()} ==")
    host = [r for r in ROWS if r["section"] == "host" and r.get("t_ms")]
    if host:
        print("\nhost time per call (us), eager do_bench (ms), CUDA graph (ms):")
        for r in host:
            print(f"{r['M']:>7} {r['K']:>5} {r['path'][:58]:58} {fmt(r.get('t_host_us'), 1):>8} "
                  f"{fmt(r['t_ms'], 4):>8} {fmt(r.get('t_graph_ms'), 4):>8}")  # fmt: skip
    tune = [r for r in ROWS if r["section"] == "tune"]
    if tune:
        print("\ntile sweeps (ms, TFLOP/s, ok):")
        for r in tune:
            print(f"{r['M']:>7} {r['K']:>5} {r['N']:>5} {r['path'][:70]:70} {fmt(r.get('t_ms'), 4):>8} "
                  f"{fmt(r.get('tflops'), 0):>6} {r['ok']} {r['error'][:60]}")  # fmt: skip
    sh = shapes()
    print("\nforward x[M,K] W[N,K]^T, speedup over bf16 torch.mm (quantization of x included):")
    print(f"{'M':>7} {'K':>5} {'N':>5} {'bf16 ms':>8} {'prequant':>8} {'compiled':>8} {'torchao':>8} "
          f"{'ours':>6} {'share':>6}  best path")  # fmt: skip
    for M in sh["M"]:
        for K, N in sh["KN"]:
            bf = _t("bf16 torch.mm", M, K, N)
            if bf is None:
                continue
            ceil, comp = (
                _t("prequant scaled_mm row", M, K, N),
                _t("compiled dynquant + scaled_mm row", M, K, N),
            )
            ao = _t("torchao dynamic fp8 row (compiled)", M, K, N)
            best = _best([r for r in ROWS if r["section"] == "fwd" and r["path"].startswith("ours")
                          and (r["M"], r["K"], r["N"]) == (M, K, N)])  # fmt: skip
            print(f"{M:>7} {K:>5} {N:>5} {fmt(bf):>8} {fmt(ceil and bf / ceil, 2):>8} "
                  f"{fmt(comp and bf / comp, 2):>8} {fmt(ao and bf / ao, 2):>8} "
                  f"{fmt(best and best['speedup_vs_bf16'], 2):>6} {fmt(best and best.get('ratio'), 2):>6}  "
                  f"{best['path'] if best else '-'}")  # fmt: skip
    print(
        "\nLayerNorm -> Linear forward, speedup over LayerNorm + bf16 mm (share: of free quantization):"
    )
    for r in ROWS:
        if (
            r["section"] == "lnfwd"
            and r.get("speedup_vs_bf16")
            and not r["path"].startswith("bf16")
        ):
            print(f"{r['M']:>7} {r['K']:>5} {r['N']:>5} {r['path'][:56]:56} "
                  f"{fmt(r['speedup_vs_bf16'], 2):>6} {fmt(r.get('ratio'), 2):>6}")  # fmt: skip
    print(
        "\nGEMM alone on the same FP8 operands: cuBLAS/CUTLASS time / Triton time (>1: Triton faster):"
    )
    for r in ROWS:
        if r["section"] == "gemm" and r["backend"].startswith("triton.") and r.get("ratio"):
            print(
                f"{r['M']:>7} {r['K']:>5} {r['N']:>5} {r['backend']:16} {r['recipe']:16} {fmt(r['ratio'], 2)}"
            )
    print("\nnorms: time / the norm alone (aim for layernorm+quantize: <= 1.10):")
    for r in ROWS:
        if r["section"] == "norm" and r.get("ratio") and not r["path"].startswith("F."):
            print(f"{r['M']:>7} {r['K']:>5} {r['path']:40} {fmt(r['ratio'], 2)}")
    print("\nbackward dgrad+wgrad (transpose-quantization of dY included), speedup over bf16:")
    for r in ROWS:
        if r["section"] == "bwd" and r["path"].startswith("ours") and r.get("speedup_vs_bf16"):
            print(
                f"{r['M']:>7} {r['K']:>5} {r['N']:>5} {r['path'][:70]:70} {fmt(r['speedup_vs_bf16'], 2)}"
            )
    print("\ngrouped GEMMs, speedup over a loop of bf16 F.linear:")
    for r in ROWS:
        if r["section"] == "grouped" and r.get("speedup_vs_bf16"):
            print(
                f"{r['M']:>7} {r['K']:>5} {r['N']:>5} {r['path'][:60]:60} {fmt(r['speedup_vs_bf16'], 2)}"
            )
    bad = [c for c in CHECKS if not c["ok"]]
    print(
        f"\nbyte-exact quantization checks on this device: {len(CHECKS) - len(bad)}/{len(CHECKS)} passed"
    )
    for c in bad:
        print("  FAILED", c["check"], c.get("error", ""))
    skipped = [r for r in ROWS if r["error"].startswith("skipped")]
    failing = [r for r in ROWS if not r["ok"]]
    print(
        f"rows: {len(ROWS)}; skipped (budget): {len(skipped)}; failed or over the error bound: {len(failing)}"
    )
    for r in failing:
        print(
            f"  {r['section']} {r['path']} M={r['M']} K={r['K']} N={r['N']} err={fmt(r.get('rel_err'), 4)} {r['error'][:120]}"
        )
    for name, a in aim.items():
        print(f"aim {name}: met at {a['met']}/{a['of']} shapes; worst {a['worst']}")


def device_name() -> str:
    return (
        torch.cuda.get_device_name(DEVICE)
        if GPU
        else f"cpu ({platform.processor() or 'unknown'}), Triton interpreter"
    )


STAMP = [""]  # one name for every (partial) write of a run, set by main()


def write(aim: dict) -> None:
    base = Path(ARGS.out) / f"kernels_{MODE}_{STAMP[0]}"
    write_csv(base.with_suffix(".csv"), ROWS, FIELDS)
    meta = metadata(
        DEVICE,
        mode=MODE,
        device=device_name(),
        budget_s=BUDGET.seconds,
        backends={b.name: b.description for b in registry.backends()},
        available=registry.available(DEVICE) if GPU else [],
        wall_s=round(BUDGET.elapsed(), 1),
        timing="triton.testing.do_bench median (eager, launch overhead included); t_graph_ms: "
        "do_bench_cudagraph median for small shapes where capturable",
        aims=aim,
        tuned_defaults=TUNED,
        checks=CHECKS,
    )
    write_json(base.with_suffix(".json"), meta)
    print(f"\nwrote {base}.csv and {base}.json")


def main(argv: list[str] | None = None) -> int:
    global ARGS, MODE, BUDGET
    ARGS = parse_args(argv)
    MODE = mode_of(ARGS)
    if MODE == "quick":
        os.environ.setdefault("LOKA_KERNELS_AUTOTUNE", "0")  # one heuristic tile: fast compiles
    BUDGET = Budget(ARGS.budget_s or {"smoke": 60.0, "quick": 150.0, "full": 330.0}[MODE])
    STAMP[0] = stamp()
    sel = set(ARGS.sections.split(","))
    sh = shapes()
    use_compile = GPU and not ARGS.no_compile
    if GPU:
        byte_exact_checks()
    torch._dynamo.config.cache_size_limit = 64  # never fall back to eager silently
    compiled = compiled_dynamic_rowwise() if use_compile else None
    compiled_norm = compiled_norm_quant() if use_compile else None
    compiled_ln = compiled_ln_linear() if use_compile else None
    for name, run in (
        ("tune", bench_tune),
        ("host", lambda: [bench_host(M, K) for M, K in sh["host"]]),
        (
            "fwd",
            lambda: [bench_fwd_and_gemm(M, K, N, compiled) for M in sh["M"] for K, N in sh["KN"]],
        ),
        (
            "lnfwd",
            lambda: [
                bench_ln_linear(M, K, N, compiled_ln)
                for M in sh["M"]
                for K, N in sh["KN"]
                if MODE != "full" or min(K, N) >= 1024
            ],
        ),
        ("norm", lambda: [bench_norm(M, N, compiled_norm) for M in sh["M"] for N in sh["norm_N"]]),
        ("bwd", lambda: [bench_bwd(M, K, N) for M in sh["M"] for K, N in sh["KN"]]),
        ("grouped", lambda: [bench_grouped(*cfg) for cfg in sh["grouped"]]),
    ):
        if name in sel or (name == "fwd" and "gemm" in sel):
            later = [k for k in SECTION_SHARE if k in sel or k == name]
            share = SECTION_SHARE[name] / sum(SECTION_SHARE[k] for k in later[later.index(name) :])
            DEADLINE[0] = BUDGET.share(share)
            try:
                run()
            except Exception:  # a whole section failing is recorded, the others still run
                ROWS.append({"section": name, "path": "SECTION FAILED", "M": 0, "K": 0, "N": 0,
                             "pass": "", "ok": False, "error": traceback.format_exc()[-300:]})  # fmt: skip
            if GPU:
                torch.cuda.empty_cache()
            write({})  # what is done so far survives a run cut short
    derive()
    aim = aims()
    write(aim)
    print_summary(aim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
