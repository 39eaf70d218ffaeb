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
    python bench/probe_budget.py            # CPU, a few minutes (the recorded run)

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
from torch import nn
from torch.nn import functional as F

import loka.zoo as zoo
from loka.probe.gemm_error import balance_weights, error_sums, relative_errors


def round_mantissa(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """`x` rounded to `bits` explicit mantissa bits (RNE), exponent unlimited."""
    if bits is None:
        return x
    mantissa, exponent = torch.frexp(x.float())  # mantissa in [0.5, 1)
    step = 2.0 ** (bits + 1)
    return torch.ldexp(torch.round(mantissa * step) / step, exponent).to(x.dtype)


class RoundedLinear(torch.autograd.Function):
    """y = x W^T + b with every GEMM operand rounded: x and W in the forward pass, the
    gradient (to `grad_bits`) and the other operand (to `bits`) in dgrad and wgrad."""

    @staticmethod
    def forward(ctx, x, weight, bias, bits, grad_bits):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.bits, ctx.grad_bits, ctx.has_bias = bits, grad_bits, bias is not None
        return F.linear(round_mantissa(x, bits), round_mantissa(weight, bits), bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g = round_mantissa(grad, ctx.grad_bits)
        dx = g @ round_mantissa(weight, ctx.bits)
        g2 = g.reshape(-1, g.shape[-1])
        dw = g2.T @ round_mantissa(x.reshape(-1, x.shape[-1]), ctx.bits)
        db = g2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


def round_all_linears(model: nn.Module, bits: int | None, grad_bits: int | None) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):

            def forward(self, x, bits=bits, grad_bits=grad_bits):
                return RoundedLinear.apply(x, self.weight, self.bias, bits, grad_bits)

            module.forward = types.MethodType(forward, module)


def forward_error(model: nn.Module, batches: list, setup, bits: int | None) -> float:
    """Mean balanced relative error of the linears' forward GEMMs at `bits` mantissa bits."""
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(
            lambda m, a, o: captured.append((a[0].reshape(-1, a[0].shape[-1]), m.weight.detach()))
        )
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    with torch.no_grad():
        for batch in batches:
            setup.loss(model, batch)
    for h in hooks:
        h.remove()
    errors = []
    for x, w in captured:
        ref = x.double() @ w.double().T
        out = round_mantissa(x, bits).double() @ round_mantissa(w, bits).double().T
        errors.append(float(relative_errors(error_sums(out, ref, balance_weights(x, w)))[0]))
    return statistics.fmean(errors)


VARIANTS = {  # name: (mantissa bits of x and W, of the gradient)
    "fp32": (None, None),
    "m3 (e4m3-like)": (3, 3),
    "m3 fwd, m2 grad (e4m3/e5m2 hybrid)": (3, 2),
    "m2 (e5m2-like)": (2, 2),
    "m1": (1, 1),
    "m0": (0, 0),
}


def run(args: argparse.Namespace) -> dict:
    results = []
    probe_setup = zoo.create(args.model, "tiny", seed=0)
    eval_batches = probe_setup.eval_batches(args.eval_batches)
    for name, (bits, grad_bits) in VARIANTS.items():
        if args.smoke and name not in ("fp32", "m3 (e4m3-like)"):
            continue
        err = (
            forward_error(probe_setup.model, eval_batches[:2], probe_setup, bits)
            if bits is not None
            else 0.0
        )
        for seed in range(args.seeds):
            setup = zoo.create(args.model, "tiny", seed=seed)
            round_all_linears(setup.model, bits, grad_bits)
            start = time.perf_counter()
            losses = zoo.train(setup, args.steps, lr=args.lr)
            setup.model.eval()
            with torch.no_grad():
                metrics = setup.metrics(setup.model, eval_batches)
            results.append(
                {
                    "variant": name,
                    "bits": bits,
                    "grad_bits": grad_bits,
                    "seed": seed,
                    "fwd_balanced_rel_err": err,
                    "final_train_loss": statistics.fmean(losses[-20:]),
                    **{f"eval_{k}": v for k, v in metrics.items()},
                    "train_s": time.perf_counter() - start,
                }
            )
            print(f"{name:38s} seed {seed}: err {err:.4f}  {metrics}", flush=True)
    return {"runs": results}


def summarize(runs: list[dict]) -> list[dict]:
    base = [r["eval_logloss"] for r in runs if r["variant"] == "fp32"]
    lo, hi = min(base), max(base)
    rows = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        loss = [r["eval_logloss"] for r in mine]
        rows.append(
            {
                "variant": name,
                "fwd_balanced_rel_err": mine[0]["fwd_balanced_rel_err"],
                "eval_logloss_mean": statistics.fmean(loss),
                "eval_logloss_min": min(loss),
                "eval_logloss_max": max(loss),
                "eval_auc_mean": statistics.fmean(r["eval_auc"] for r in mine),
                "vs_fp32_band": "inside"
                if lo <= statistics.fmean(loss) <= hi
                else (
                    "below"
                    if statistics.fmean(loss) < lo
                    else f"above by {statistics.fmean(loss) - hi:.4f}"
                ),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 variants, 1 seed, 20 steps")
    p.add_argument("--model", default="dhen")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.smoke:
        args.steps, args.seeds, args.eval_batches = 20, 1, 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    data = run(args)
    summary = summarize(data["runs"])
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - start, 1),
        "args": vars(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = out / f"probe_budget_{'smoke' if args.smoke else 'cpu'}_{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary, **data}, indent=1))
    print(
        f"\n{'variant':38s} {'fwd err':>8s} {'eval logloss (min..max)':>28s} {'AUC':>7s}  vs fp32 band"
    )
    for row in summary:
        print(
            f"{row['variant']:38s} {row['fwd_balanced_rel_err']:8.4f} "
            f"{row['eval_logloss_mean']:10.5f} ({row['eval_logloss_min']:.5f}..{row['eval_logloss_max']:.5f})"
            f" {row['eval_auc_mean']:7.4f}  {row['vs_fp32_band']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
