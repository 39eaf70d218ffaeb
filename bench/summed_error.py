"""What an FP8 dgrad does to the gradients upstream of it, where the batch's gradients cancel.

Trains a zoo model in bf16 autocast for `--steps`, then on `--batches` fresh batches takes
the weight gradients of every dense linear (float32, no autocast) exactly and with the
dgrad of the linears named by each `--sites` set (globs; sets split by `;`) computed
another way: through a bf16 GEMM, through rowwise e4m3 (`row`), or through rowwise e4m3
of the gradient with its batch mean taken out and the mean's product added back exactly
(`center`). Every other pass stays exact. Per group of weights upstream (`--groups`) it
reports the relative error of their gradient on each batch (`per_batch`), the error of the
gradient averaged over the batches (`averaged`: an error that persists from batch to
batch, a bias, keeps its size there, noise shrinks), and how much the exact gradient
itself moves from batch to batch (`noise`). Beside them, Probe's summed error of each
site's dgrad (`packages/probe/README.md`, "The gradient's sum over the batch") on the same
batches, in the same three ways, from the output gradients of a bf16-autocast step (the
ones training quantizes; the upstream errors above are of a float32 step, so that only the
named dgrads differ).

    python bench/summed_error.py --model dhen --preset large --batch 1024 --steps 40

Results: summed_error_<device>_<utc time>.json in --out (default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import os
import time
from pathlib import Path

import torch
from harness import metadata, write_json
from torch import nn
from varying_error import rowwise

import loka.zoo as zoo
from loka.probe.gemm_error import PassOperands, pass_error_sums, relative_errors
from loka.schema import Recipe

WAYS = ("bf16", "row", "center")


def dgrad(dy: torch.Tensor, weight: torch.Tensor, way: str) -> torch.Tensor:
    """`dy @ weight` (`dy [M, N]`, `weight [N, K]`) computed `way`, float32."""
    dy, weight = dy.float(), weight.float()
    if way == "bf16":
        return (dy.bfloat16().float() @ weight.bfloat16().float()).bfloat16().float()
    weight_q = rowwise(weight.T).T  # one scale per input channel, the dgrad's output
    if way == "row":
        return rowwise(dy) @ weight_q
    mean = dy.mean(dim=0, keepdim=True)
    return rowwise(dy - mean) @ weight_q + mean @ weight


class _Linear(torch.autograd.Function):
    """A linear whose dgrad is computed `way`; its wgrad and bias gradient stay exact."""

    @staticmethod
    def forward(ctx, x, weight, bias, way):
        ctx.save_for_backward(x, weight)
        ctx.way = way
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        dx = dgrad(dy, weight, ctx.way).reshape(*grad.shape[:-1], weight.shape[1])
        dw = dy.T.float() @ x.reshape(-1, x.shape[-1]).float()
        return dx.to(x.dtype), dw.to(weight.dtype), dy.sum(dim=0), None


def route(model: nn.Module, ways: dict[str, str], seen: dict[str, torch.Tensor]) -> list:
    """Every nn.Linear's forward through `_Linear` where `ways` names it; the output
    gradients of those linears kept in `seen` (for their summed errors). Returns the hooks."""
    hooks = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue

        def forward(x: torch.Tensor, module: nn.Linear = module, name: str = name) -> torch.Tensor:
            way = ways.get(name)
            if way is None:
                return nn.functional.linear(x, module.weight, module.bias)
            return _Linear.apply(x, module.weight, module.bias, way)

        module.forward = forward
        hooks.append(module.register_full_backward_hook(
            lambda mod, gin, gout, name=name: seen.__setitem__(name, gout[0].detach())
        ))  # fmt: skip
    return hooks


def summed_errors(dy: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    """Probe's summed error of this dgrad (the whole batch, no sampling) per way."""
    dy = dy.reshape(-1, dy.shape[-1]).bfloat16()
    ops = PassOperands(dy, weight.bfloat16().T, False, True, dy.abs().amax(),
                       weight.abs().amax(), token_rows=True, summed_total=dy.shape[0])  # fmt: skip
    recipes = [Recipe.parse(t) for t in ("e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/center")]
    sums, _ = pass_error_sums(ops, recipes, out_dtype=torch.bfloat16)
    summed = relative_errors(sums).summed.tolist()
    return dict(zip(WAYS, summed, strict=True))


def run(args: argparse.Namespace) -> dict:
    setup = zoo.create(args.model, args.preset, device=torch.device(args.device),
                       batch_size=args.batch, seed=args.seed)  # fmt: skip
    t0 = time.monotonic()
    losses = zoo.train(setup, args.steps, autocast_dtype=torch.bfloat16)
    print(f"[summed] {args.model} {args.preset}: {args.steps} steps in "
          f"{time.monotonic() - t0:.0f} s, last loss {losses[-1]:.4f}", flush=True)  # fmt: skip
    model = setup.model
    seen: dict[str, torch.Tensor] = {}
    ways: dict[str, str] = {}
    hooks = route(model, ways, seen)
    batches_iter = setup.train_batches()
    batches = [next(batches_iter) for _ in range(args.batches)]
    # only the weights of the groups are kept, once per batch and way (an embedding table's
    # gradient would be the size of the table every time)
    named = dict(model.named_parameters())
    groups = {g: [n for n in named if fnmatch.fnmatch(n, g)] for g in args.groups.split(",")}
    groups = {g: names for g, names in groups.items() if names}
    weights = {n: named[n] for names in groups.values() for n in names}
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear}

    def gradients(batch, site_ways: dict[str, str]) -> dict[str, torch.Tensor]:
        ways.clear()
        ways.update(site_ways)
        model.zero_grad(set_to_none=True)
        setup.loss(model, batch).backward()
        return {n: p.grad.detach().clone() for n, p in weights.items() if p.grad is not None}

    exact = [gradients(b, {}) for b in batches]
    rows = []
    for sites_glob in args.sites.split(";"):
        sites = sorted(
            n for n in linears if any(fnmatch.fnmatch(n, g) for g in sites_glob.split(","))
        )
        summed = {s: {w: [] for w in WAYS} for s in sites}
        modules = dict(model.named_modules())
        for batch in batches:  # the output gradients as training makes them: bf16 autocast
            seen.clear()
            ways.clear()
            with torch.autocast(setup.device.type, dtype=torch.bfloat16):
                loss = setup.loss(model, batch)
            loss.backward()
            for s in sites:
                for w, e in summed_errors(seen[s], modules[s].weight.detach()).items():
                    summed[s][w].append(e)
        by_way = {
            way: [gradients(batch, dict.fromkeys(sites, way)) for batch in batches] for way in WAYS
        }
        for group, names in groups.items():
            flat = [torch.cat([g[n].flatten() for n in names]) for g in exact]
            mean_exact = torch.stack(flat).mean(dim=0)
            noise = float(
                torch.stack([f - mean_exact for f in flat]).norm(dim=1).mean() / mean_exact.norm()
            )
            for way in WAYS:
                got = [torch.cat([g[n].flatten() for n in names]) for g in by_way[way]]
                per_batch = [
                    float((g - f).norm() / f.norm()) for g, f in zip(got, flat, strict=True)
                ]
                averaged = float(
                    (torch.stack(got).mean(dim=0) - mean_exact).norm() / mean_exact.norm()
                )
                rows.append({"sites": sites_glob, "way": way, "group": group,
                             "per_batch": sum(per_batch) / len(per_batch),
                             "averaged": averaged, "noise": noise})  # fmt: skip
                print(f"[summed] dgrad of {sites_glob} {way:6s} -> {group:28s} "
                      f"per batch {rows[-1]['per_batch']:.4f}, averaged {averaged:.4f} "
                      f"(batch-to-batch {noise:.3f})", flush=True)  # fmt: skip
        for s in sites:
            rows.append({"sites": sites_glob, "site": s, "summed_error": {
                w: sum(v) / len(v) for w, v in summed[s].items()}})  # fmt: skip
            print(f"[summed] {s} summed error " + ", ".join(
                f"{w} {sum(v) / len(v):.4f}" for w, v in summed[s].items()), flush=True)  # fmt: skip
    for h in hooks:
        h.remove()
    return {"loss_last": losses[-1], "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="large")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--sites", default="blocks.3.fc2;blocks.*.fc2;blocks.*.fc1")
    p.add_argument("--groups", default="blocks.*.fc1.weight,blocks.*.fc2.weight,"
                   "input_projection.weight,projections.*.weight")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) / f"summed_error_{torch.device(args.device).type}_{stamp}.json"
    result = run(args)
    write_json(out, {"meta": metadata(args.device, **{k: v for k, v in vars(args).items()
                                                       if k != "device"}), **result})  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
