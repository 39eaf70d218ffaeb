"""Does centering keep the quality that a plain FP8 forward loses where hidden states collapse?

A controlled A/B on the CPU (FP8 numerics through `torch.native.cpu`): a zoo model trained
from the same seeds and batches three ways, every linear named by `--sites` running its
forward (or with `--pass dgrad` its dgrad) in rowwise e4m3 plainly, or centered
(`.../center`), or not at all (bf16 autocast throughout); the other passes stay high
precision in all three, so only that pass's FP8 rounding differs. Reports the eval metrics
after `--steps` and the loss curve of each run.

    python bench/center_quality.py --model dhen --preset base --steps 400 --seeds 0,1,2
    python bench/center_quality.py --preset large --batch 1024 --sites 'blocks.*.fc2' --pass dgrad

Results: center_quality_<utc time>.json in --out (default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import os
import statistics
import time
from pathlib import Path

import torch
from harness import metadata, write_json
from torch import nn

import loka.zoo as zoo
from loka.mods import Fp8Linear, Fp8LinearConfig, PassConfig

CPU = "torch.native.cpu"
RECIPES = {"plain": "e4m3:e4m3/row/dynamic", "center": "e4m3:e4m3/row/dynamic/center"}


def convert(model: nn.Module, patterns: list[str], recipe: str, pass_: str = "fwd") -> list[str]:
    """Every nn.Linear matching `patterns` swapped for an Fp8Linear whose `pass_` (fwd or
    dgrad) runs `recipe`, its other passes in high precision; the names swapped."""
    fp8, high = PassConfig(recipe, CPU), PassConfig("bf16")
    config = Fp8LinearConfig(*(fp8 if p == pass_ else high for p in ("fwd", "dgrad", "wgrad")))
    names = [
        n
        for n, m in model.named_modules()
        if type(m) is nn.Linear and any(fnmatch.fnmatch(n, p) for p in patterns)
    ]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), config))
    return names


def run(args: argparse.Namespace, seed: int, variant: str) -> dict:
    setup = zoo.create(args.model, args.preset, seed=seed, batch_size=args.batch)
    swapped = []
    if variant != "bf16":
        swapped = convert(setup.model, args.sites.split(","), RECIPES[variant], args.pass_)
    t0 = time.monotonic()
    losses = zoo.train(setup, args.steps, autocast_dtype=torch.bfloat16, lr=args.lr)
    setup.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        metrics = setup.metrics(setup.model, setup.eval_batches(args.eval_batches))
    every = max(1, args.steps // 40)
    return {
        "seed": seed, "variant": variant, "fp8_sites": swapped, "metrics": metrics,
        "loss_curve": [statistics.fmean(losses[i:i + every]) for i in range(0, len(losses), every)],
        "loss_last": statistics.fmean(losses[-every:]), "train_s": time.monotonic() - t0,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dhen")
    p.add_argument("--preset", default="base")
    p.add_argument("--sites", default="blocks.*,head.*", help="globs of the FP8 forwards")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "dgrad"), default="fwd",
                   help="the pass that runs FP8 at those sites (dgrad: the gradient's summed "
                        "part, `packages/probe/README.md`)")  # fmt: skip
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="bf16,plain,center")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) / f"center_quality_{stamp}.json"
    meta = metadata("cpu", **vars(args))
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for variant in args.variants.split(","):
            row = run(args, seed, variant)
            rows.append(row)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in row["metrics"].items())
            print(f"[center] seed {seed} {variant:6s}: {shown}; last loss "
                  f"{row['loss_last']:.4f} ({row['train_s']:.0f} s)", flush=True)  # fmt: skip
            write_json(out, {"meta": meta, "runs": rows})  # after every run
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
