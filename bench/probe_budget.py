"""What per-GEMM error a model's training tolerates: the evidence behind Probe's budgets.

Trains a zoo model (default: DHEN tiny, CPU) with every nn.Linear's three GEMMs (forward
x W^T, dgrad dY W, wgrad dY^T x) computed on operands rounded to m mantissa bits
(round-to-nearest-even, tensorwise, with an unlimited exponent: no saturation, no flush to
zero), for several m, against the unrounded fp32 model over several seeds. m = 3 is
e4m3's precision and m = 2 e5m2's, so the variants are FP8 GEMMs on perfectly conditioned
data, at error levels a factor two apart. For each variant the script reports

- the measured balanced relative error of the forward GEMMs (the statistic Probe's
  verdicts use, `loka.probe.gemm_error`), averaged over the model's linears on held-out
  batches;
- eval logloss / NE / AUC after training, and their gap to the fp32 seed band.

    python bench/probe_budget.py --smoke    # seconds: proves it runs
    python bench/probe_budget.py            # CPU: 6 variants x 3 seeds x 200 steps
    python bench/probe_budget.py --variants fp32,m3m2 --resume bench/results/probe_budget_cpu.json
        # the same in pieces: each call adds the variants it runs to the file

Results: probe_budget_<device>_<utc time>.json in --out (default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from harness import write_json
from torch import nn
from torch.nn import functional as F

import loka.zoo as zoo
from loka.probe.gemm_error import balance_weights, error_sums, relative_errors


def round_mantissa(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """`x` rounded to `bits` explicit mantissa bits (RNE), exponent unlimited.

    Integer arithmetic on the float32 bit pattern: add half an ulp of the target precision
    (minus one, plus the lowest kept bit: ties to even), then clear the dropped bits. A
    carry into the exponent is the correct rounding up to the next binade."""
    if bits is None:
        return x
    drop = 23 - bits
    b = x.float().contiguous().view(torch.int32)
    b = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~((1 << drop) - 1)
    return b.view(torch.float32).to(x.dtype)


def flush_rows(g: torch.Tensor, fraction: float) -> torch.Tensor:
    """`g [M, N]` with its rows of the lowest `fraction` of norms set to zero."""
    if not fraction:
        return g
    norms = g.norm(dim=1)
    return torch.where((norms < torch.quantile(norms, fraction))[:, None], 0.0, g)


class RoundedLinear(torch.autograd.Function):
    """y = x W^T + b with every GEMM operand rounded: x and W in the forward pass, the
    gradient (to `grad_bits`) and the other operand (to `bits`) in dgrad and wgrad. With
    `flush` > 0 the gradient rows (samples) whose norm is in the lowest `flush` fraction are
    zeroed in both backward GEMMs: what tensorwise e4m3 does to per-sample gradients
    spread over more binades than it holds. The bias gradient stays exact."""

    @staticmethod
    def forward(ctx, x, weight, bias, bits, grad_bits, flush):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.bits, ctx.grad_bits, ctx.flush, ctx.has_bias = bits, grad_bits, flush, bias is not None
        return F.linear(round_mantissa(x, bits), round_mantissa(weight, bits), bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g = flush_rows(round_mantissa(grad, ctx.grad_bits).reshape(-1, grad.shape[-1]), ctx.flush)
        dx = (g @ round_mantissa(weight, ctx.bits)).reshape(*grad.shape[:-1], -1)
        dw = g.T @ round_mantissa(x.reshape(-1, x.shape[-1]), ctx.bits)
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None, None


def round_all_linears(
    model: nn.Module, bits: int | None, grad_bits: int | None, flush: float = 0.0
) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):

            def forward(self, x, bits=bits, grad_bits=grad_bits, flush=flush):
                return RoundedLinear.apply(x, self.weight, self.bias, bits, grad_bits, flush)

            module.forward = types.MethodType(forward, module)


def gemm_errors(
    setup, batches: list, bits: int | None, grad_bits: int | None, flush: float
) -> dict:
    """Balanced and plain relative errors of the three GEMMs of every linear of
    `setup.model` (unrounded, as initialized) under a variant, averaged over the linears."""
    captured: list[list[torch.Tensor]] = []

    def hook(module, args, output):
        entry = [args[0].detach().reshape(-1, args[0].shape[-1]), module.weight.detach()]
        captured.append(entry)
        output.register_hook(lambda g: entry.append(g.detach().reshape(-1, g.shape[-1])))

    linears = [m for m in setup.model.modules() if isinstance(m, nn.Linear)]
    hooks = [m.register_forward_hook(hook) for m in linears]
    for batch in batches:
        setup.loss(setup.model, batch).backward()
    setup.model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    sums: dict[str, list[tuple[float, float]]] = {"fwd": [], "dgrad": [], "wgrad": []}
    for x, w, g in (e for e in captured if len(e) == 3):
        xr, wr = round_mantissa(x, bits), round_mantissa(w, bits)
        gr = flush_rows(round_mantissa(g, grad_bits), flush)
        for pass_, (a, b, ar, br) in {
            "fwd": (x, w, xr, wr),
            "dgrad": (g, w.T, gr, wr.T),
            "wgrad": (g.T, x.T, gr.T, xr.T),
        }.items():
            ref = a.double() @ b.double().T
            out = ar.double() @ br.double().T
            balanced, plain = relative_errors(error_sums(out, ref, balance_weights(a, b)))[:2]
            if torch.isfinite(balanced):
                sums[pass_].append((float(balanced), float(plain)))
    return {
        f"{p}_{kind}": statistics.fmean(v[i] for v in values)
        for p, values in sums.items()
        for i, kind in enumerate(("balanced", "plain"))
    }


VARIANTS = {  # name: (mantissa bits of x and W, of the gradient, flushed rows, meaning)
    "fp32": (None, None, 0.0, "unrounded reference"),
    "m3": (3, 3, 0.0, "e4m3 precision everywhere"),
    "m3m2": (3, 2, 0.0, "e4m3 x and W, e5m2 gradient (hybrid)"),
    "m2": (2, 2, 0.0, "e5m2 precision everywhere"),
    "m1": (1, 1, 0.0, "one mantissa bit"),
    "m0": (0, 0, 0.0, "powers of two only"),
    "m3f25": (3, 3, 0.25, "e4m3, smallest 25% gradient rows flushed"),
    "m3f50": (3, 3, 0.5, "e4m3, smallest 50% gradient rows flushed"),
}


def run(args: argparse.Namespace, done: set[str]) -> list[dict]:
    results = []
    eval_batches = zoo.create(args.model, "tiny", seed=0).eval_batches(args.eval_batches)
    for name, (bits, grad_bits, flush, meaning) in VARIANTS.items():
        if name in done or (args.variants and name not in args.variants):
            continue
        for seed in range(args.seeds):
            setup = zoo.create(args.model, "tiny", seed=seed)
            round_all_linears(setup.model, bits, grad_bits, flush)
            start = time.perf_counter()
            losses = zoo.train(setup, args.steps, lr=args.lr)
            setup.model.eval()
            with torch.no_grad():
                metrics = setup.metrics(setup.model, eval_batches)
            results.append(
                {
                    "variant": name,
                    "meaning": meaning,
                    "bits": bits,
                    "grad_bits": grad_bits,
                    "flushed_grad_rows": flush,
                    "seed": seed,
                    "final_train_loss": statistics.fmean(losses[-20:]),
                    **{f"eval_{k}": v for k, v in metrics.items()},
                    "train_s": time.perf_counter() - start,
                }
            )
            print(f"{name:5s} seed {seed}: {metrics}", flush=True)
    return results


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarize(runs: list[dict], model: str) -> list[dict]:
    """One row per variant: its GEMM errors (measured on the initial model) and the eval
    metrics of its runs against the fp32 runs' band (min..max over seeds)."""
    base = [r["eval_logloss"] for r in runs if r["variant"] == "fp32"]
    lo, hi = min(base), max(base)
    setup = zoo.create(model, "tiny", seed=0)
    batches = setup.eval_batches(2)
    rows = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        bits, grad_bits, flush, meaning = VARIANTS[name]
        mine = [r for r in runs if r["variant"] == name]
        loss = statistics.fmean(r["eval_logloss"] for r in mine)
        band = (
            "inside"
            if lo <= loss <= hi
            else ("below" if loss < lo else f"above by {loss - hi:.5f}")
        )
        rows.append(
            {
                "variant": name,
                "meaning": meaning,
                **gemm_errors(setup, batches, bits, grad_bits, flush),
                "eval_logloss_mean": loss,
                "eval_logloss_min": min(r["eval_logloss"] for r in mine),
                "eval_logloss_max": max(r["eval_logloss"] for r in mine),
                "eval_auc_mean": statistics.fmean(r["eval_auc"] for r in mine),
                "vs_fp32_band": band,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 variants, 1 seed, 20 steps")
    p.add_argument(
        "--variants",
        type=lambda t: t.split(","),
        default=None,
        help="comma-separated first words of the variants to run (default: all)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a results file of an earlier invocation with the same settings: "
        "its runs are kept, its variants skipped, and it is rewritten",
    )
    p.add_argument("--model", default="dhen")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.smoke:
        args.steps, args.seeds, args.eval_batches = 20, 1, 2
        args.variants = args.variants or ["fp32", "m3"]
    previous = json.loads(args.resume.read_text()) if args.resume and args.resume.exists() else None
    settings = {k: getattr(args, k) for k in ("model", "steps", "seeds", "lr", "eval_batches")}
    if previous and previous["meta"]["settings"] != settings:
        sys.exit(f"{args.resume} was run with {previous['meta']['settings']}, not {settings}")
    runs = previous["runs"] if previous else []
    start = time.perf_counter()
    runs += run(args, {r["variant"] for r in runs})
    summary = summarize(runs, args.model)
    command = " ".join(["python", *sys.argv])
    meta = {
        "commands": [*previous["meta"]["commands"], command] if previous else [command],
        "settings": settings,
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - start, 1)
        + (previous["meta"]["wall_s"] if previous else 0),
    }
    if args.resume:
        path = args.resume
    else:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        path = Path(args.out) / f"probe_budget_{'smoke' if args.smoke else 'cpu'}_{stamp}.json"
    write_json(path, {"meta": meta, "summary": summary, "runs": runs})
    print(
        f"\n{'variant':6s} {'meaning':42s} {'fwd err':>8s} {'dgrad err (plain)':>18s} "
        f"{'eval logloss (min..max)':>28s} {'AUC':>7s}  vs fp32 band"
    )
    for row in summary:
        print(
            f"{row['variant']:6s} {row['meaning']:42s} {row['fwd_balanced']:8.4f} "
            f"{row['dgrad_balanced']:8.4f} ({row['dgrad_plain']:.4f}) "
            f"{row['eval_logloss_mean']:10.5f} ({row['eval_logloss_min']:.5f}..{row['eval_logloss_max']:.5f})"
            f" {row['eval_auc_mean']:7.4f}  {row['vs_fp32_band']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
