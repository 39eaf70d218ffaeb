"""Realized speed: the real training step of a LoKA plan against bf16, A/B in one process.

Per zoo model (`large` presets, fused AdamW, bf16 autocast) and execution mode (`eager`,
`compiled` = torch.compile default, `cudagraphs` = torch.compile(mode="reduce-overhead")):
1. Probe the bf16 model for `--probe-steps` eager steps (once per model; the tables serve
   every mode).
2. Plan per mode: `benchmark` times the candidates a plan for that mode may use
   (`mode_backends`: the traceable `torch.native` backend for compiled modes, the Triton and
   cuBLAS custom-op backends for eager), `make_plan(..., PlanConfig(mode=mode))`.
3. Build the variants, each its own model and optimizer: bf16 seeds 0, 1, 2 (seed 0 is the
   baseline; the other seeds give the noise band), torchao float8 (tensorwise / rowwise with
   its auto filter, when torchao is installed), and LoKA (seed 0, the plan applied).
4. Warm every variant up (compilation), then time interleaved blocks: in each block every
   variant runs `--block-steps` steps back to back on the same pre-generated batches, the
   order rotating from block to block; a block's time is CUDA events around its steps
   (one sync per block). Speedup = median(bf16 seed-0 blocks) / median(variant blocks),
   with the spread of the paired per-block ratios.
5. With `--verify` (and loka.dispatch.verify present), LoKA's plan is then put through
   Dispatch's closed-loop verification on the same step and re-measured.

    python bench/realized.py --models dhen --modes compiled,eager
Results: realized_<utc>.json under --out (default $OUT, else bench/results/): metadata,
every row (model, mode, variant, step_ms, blocks, speedup_vs_bf16, ratio spread, and for LoKA
predicted_speedup, ceiling, g, s, sites, passes, demoted), the plans' summaries.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

MODES = ("eager", "compiled", "cudagraphs")
VARIANTS = ("bf16", "bf16-seed1", "bf16-seed2", "torchao-tensorwise-auto",
            "torchao-rowwise-auto", "loka")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="dhen")
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--preset", default="large")
    p.add_argument("--probe-steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=6, help="untimed steps per variant")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--batches", type=int, default=4, help="pre-generated batches, cycled")
    p.add_argument("--bench-budget-s", type=float, default=60.0)
    p.add_argument("--cache", default=None, help="kernel_bench cache folder")
    p.add_argument("--verify", action="store_true", help="run Dispatch's verification too")
    p.add_argument("--profile", action="store_true", help="profile LoKA's and bf16's step")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    return p.parse_args(argv)


def block_stats(base: list[float], other: list[float]) -> dict:
    """Speedup of `other` over `base` from interleaved block times (ms per step): the ratio
    of medians, and the min / median / max of the paired per-block ratios."""
    ratios = [b / o for b, o in zip(base, other, strict=False)]
    return {
        "speedup_vs_bf16": statistics.median(base) / statistics.median(other),
        "ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    import loka.zoo as zoo
    from loka.probe import Probe, ProbeConfig

    start = time.monotonic()
    device = "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "cuda": torch.version.cuda,
        "preset": args.preset, "blocks": args.blocks, "block_steps": args.block_steps,
        "timing": "interleaved blocks, CUDA events around each block's steps, one sync per "
                  "block; order rotates per block",
    }  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
        import torchao

        meta["torchao"] = torchao.__version__
    except ImportError:
        meta["torchao"] = None
    rows: list[dict] = []
    plans: dict = {}
    variants = [v for v in args.variants.split(",") if v]
    if meta["torchao"] is None:
        variants = [v for v in variants if not v.startswith("torchao")]

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    for name in args.models.split(","):
        if left() < 60:
            rows.append({"model": name, "skipped": "over the time budget"})
            continue
        # -- probe once ---------------------------------------------------------------
        setup = zoo.create(name, args.preset, device=device, seed=0)
        batches = [b for b, _ in zip(setup.train_batches(), range(args.batches), strict=False)]
        P = args.probe_steps
        probe = Probe(setup.model, ProbeConfig(
            warmup_steps=P, max_sites_per_step=None, warmup_every=max(1, P // 8), every=25,
            min_batches=min(5, max(2, P // 8)), queue_size=P))  # fmt: skip
        opt = torch.optim.AdamW(setup.model.parameters(), lr=1e-3, fused=True)
        for i in range(P):
            zoo.training_step(setup, setup.model, opt, batches[i % len(batches)],
                              autocast_dtype=torch.bfloat16, check_finite=False)  # fmt: skip
            probe.step()
        tables = probe.tables()
        probe.detach()
        del setup, opt, probe
        gc.collect()
        print(f"[realized] {name}: probed {P} steps ({time.monotonic() - start:.0f} s)")
        for mode in args.modes.split(","):
            if left() < 45:
                rows.append({"model": name, "mode": mode, "skipped": "over the time budget"})
                continue
            try:
                rows += run_mode(args, name, mode, variants, tables, plans, left)
            except Exception as exc:
                rows.append({"model": name, "mode": mode, "error": f"{type(exc).__name__}: "
                             f"{exc}", "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
                print(rows[-1]["traceback"])
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()

    stamp = meta["date_utc"]
    path = out / f"realized_{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "runs": rows, "plans": plans}, indent=1,
                               default=str))  # fmt: skip
    print(f"\n== realized step speed ({args.preset}) ==")
    print(f"{'model':<7} {'mode':<10} {'variant':<24} {'fp8':>4} {'step ms':>8} {'x bf16':>7} "
          f"{'ratio min..max':>15} {'pred':>6}")  # fmt: skip
    for r in rows:
        if "step_ms" not in r:
            print(f"{r.get('model', ''):<7} {r.get('mode', ''):<10} {r.get('variant', ''):<24} "
                  f"{r.get('skipped') or r.get('error', '')[:80]}")  # fmt: skip
            continue
        pred = r.get("predicted_speedup")
        print(f"{r['model']:<7} {r['mode']:<10} {r['variant']:<24} {r.get('fp8_layers', ''):>4} "
              f"{r['step_ms']:>8.2f} {r['speedup_vs_bf16']:>7.3f} "
              f"{r['ratio_min']:>7.3f}..{r['ratio_max']:<7.3f} "
              f"{'' if pred is None else f'{pred:.3f}':>6}")  # fmt: skip
    print(f"wrote {path} ({time.monotonic() - start:.0f} s)")


def run_mode(args, name, mode, variants, tables, plans, left) -> list[dict]:
    import torch

    import loka.zoo as zoo
    from loka.dispatch import PlanConfig, apply, make_plan
    from loka.dispatch.bench import BenchCache, CostModel, benchmark, site_shapes
    from loka.dispatch.bench.runner import mode_backends

    device = "cuda"
    # Every variant (and every set of sites verification tries) is one more compiled
    # version of the same forward code: above dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 64
    sites = tables["sites"]
    bench = benchmark(
        site_shapes(sites), device=device, cache=BenchCache(args.cache),
        cost_model=CostModel.shipped(), budget_s=args.bench_budget_s,
        backends=mode_backends(mode),
    )  # fmt: skip
    plan = make_plan(sites, tables["site_errors"], bench.table, PlanConfig(mode=mode))
    s = plan.summary
    plans[f"{name}/{mode}"] = {"summary": s.__dict__, "bench_notes": bench.notes,
                               "fp8_sites": plan.fp8_sites(),
                               "table": plan.table.to_dicts()}  # fmt: skip
    print(f"[realized] {name}/{mode}: plan {s.sites_fp8} sites / {s.passes_fp8} passes, "
          f"predicted {s.predicted_speedup}, ceiling {s.ceiling}")  # fmt: skip

    made: dict[str, dict] = {}
    for variant in variants:
        seed = {"bf16-seed1": 1, "bf16-seed2": 2}.get(variant, 0)
        setup = zoo.create(name, args.preset, device=device, seed=seed)
        row = {"model": name, "mode": mode, "variant": variant, "seed": seed, "fp8_layers": 0}
        if variant.startswith("torchao"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

            recipe = "tensorwise" if "tensorwise" in variant else "rowwise"
            convert_to_float8_training(
                setup.model, config=Float8LinearConfig.from_recipe_name(recipe),
                module_filter_fn=_auto_filter_for_recipe(recipe, filter_fqns=[]),
            )  # fmt: skip
            row["fp8_layers"] = sum(
                type(m).__name__ == "Float8Linear" for m in setup.model.modules()
            )
        if variant == "loka":
            applied = apply(setup.model, plan)
            row |= {"fp8_layers": len(applied.sites), "predicted_speedup": s.predicted_speedup,
                    "ceiling": s.ceiling, "g": s.gemm_share, "s": s.prequant_speedup,
                    "passes_fp8": s.passes_fp8, "demoted": {}}  # fmt: skip
            made_applied = applied
        model = setup.model
        if mode == "compiled":
            model = torch.compile(setup.model)
        elif mode == "cudagraphs":
            model = torch.compile(setup.model, mode="reduce-overhead")
        opt = torch.optim.AdamW(setup.model.parameters(), lr=1e-3, fused=True)
        made[variant] = {"setup": setup, "model": model, "opt": opt, "row": row}
    batches = [b for b, _ in zip(made["bf16"]["setup"].train_batches(), range(args.batches),
                                 strict=False)]  # fmt: skip
    cudagraphs = mode == "cudagraphs"

    def step_fn(v, i):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return zoo.training_step(v["setup"], v["model"], v["opt"], batches[i % len(batches)],
                                 autocast_dtype=torch.bfloat16, check_finite=False)  # fmt: skip

    for v in made.values():
        t0 = time.monotonic()
        try:
            for i in range(args.warmup_steps):
                step_fn(v, i)
            torch.cuda.synchronize()
        except Exception as exc:
            v["row"]["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            v["row"]["traceback"] = traceback.format_exc()[-3000:]
            print(v["row"]["traceback"])
        v["row"]["warmup_s"] = time.monotonic() - t0
    live = [k for k, v in made.items() if "error" not in v["row"]]
    if args.verify and "loka" in live:
        # The closed loop first, so that the blocks below time the plan it settled on.
        made["loka"]["row"] |= verify_loka(made["loka"], step_fn, made_applied)
    times: dict[str, list[float]] = {k: [] for k in live}
    ev = torch.cuda.Event
    for block in range(args.blocks):
        order = live[block % len(live) :] + live[: block % len(live)]
        for variant in order:
            v = made[variant]
            a, b = ev(enable_timing=True), ev(enable_timing=True)
            a.record()
            for i in range(args.block_steps):
                step_fn(v, i)
            b.record()
            b.synchronize()
            times[variant].append(a.elapsed_time(b) / args.block_steps)
        if left() < 20:
            break
    if args.profile:
        for variant in ("bf16", "loka"):
            if variant in live:
                made[variant]["row"]["profile"] = profile(made[variant], step_fn, out=args.out,
                                                          tag=f"{name}_{mode}_{variant}")  # fmt: skip
    rows = []
    base = times.get("bf16")
    for variant, v in made.items():
        row = v["row"]
        if variant in times and times[variant] and base:
            row |= {"step_ms": statistics.median(times[variant]), "blocks_ms": times[variant],
                    **block_stats(base, times[variant])}  # fmt: skip
        rows.append(row)
    band = [r["speedup_vs_bf16"] for r in rows if r["variant"].startswith("bf16") and "speedup_vs_bf16" in r]  # fmt: skip
    for r in rows:
        r["bf16_band"] = (min(band), max(band)) if band else None
    made.clear()
    return rows


def verify_loka(v, step_fn, applied) -> dict:
    """Dispatch's closed loop (`loka.dispatch.verify`) on LoKA's model and its own step."""
    from loka.dispatch.verify import VerifyConfig, verify

    counter = iter(range(10**9))
    t0 = time.monotonic()
    config = VerifyConfig(steps_per_block=8, blocks=3, drop=2, max_rounds=3)
    result = verify(lambda: step_fn(v, next(counter)), applied, config)
    return {
        "verify_s": time.monotonic() - t0,
        "verified_speedup": result.speedup, "verified_interval": [result.low, result.high],
        "verify_steps": result.steps, "demoted": dict(result.demoted),
        "fp8_layers": len(result.kept), "verify_lines": result.lines(),
        "verify_rounds": [r.as_dict() for r in result.rounds],
    }  # fmt: skip


def profile(v, step_fn, out, tag) -> dict:
    """torch.profiler over a few steps: CUDA and CPU time per step, top kernels by time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    steps = 4
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step_fn(v, i)
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=25)
    Path(out, f"profile_{tag}.txt").write_text(table)
    cuda_total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    return {
        "gpu_ms_per_step": cuda_total,
        "top": [
            (e.key[:80], e.self_device_time_total / 1e3 / steps, e.count // steps) for e in top
        ],
    }


if __name__ == "__main__":
    main()
