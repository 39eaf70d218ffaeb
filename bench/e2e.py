"""LoKA end to end on the zoo's large models (one H200): training step time, eval quality and
inference time, side by side in one run.

Per model (dlrm, dhen, wukong, hstu; `large` presets, AdamW, bf16 autocast, fresh data every
step, the same steps and data order for every variant of a seed):
- bf16, seeds 0 and 1: the baseline and its noise band (seed changes init and data order);
- torchao float8 training, tensorwise and rowwise, on all linears and with torchao's auto
  filter (`_auto_filter_for_recipe`);
- LoKA: bf16 warm-up with Probe, plan from the live `kernel_bench` (measured here through
  the cache; shapes past the bench budget are estimated from the shipped H200 table and the
  plan says so), apply, continue (seed 0: same init and data as bf16 seed 0).
Training time: median CUDA-event time of `loka.zoo.training_step` over the last `--timed`
steps (LoKA: only steps after the plan is applied; data generation is outside the timed
region). Quality: the model's eval metrics after all steps (NE for the CTR models, NDCG@10
for HSTU). Inference: median `triton.testing.do_bench` time of a forward pass (eval, no grad,
bf16 autocast) of the seed-0 model: bf16, torchao dynamic float8 rowwise (`quantize_`), and
LoKA's inference plan (`PlanConfig(inference=True)`: forward passes only).
Every variant runs eager unless `--compile` (then every variant is compiled; LoKA after its
plan is applied). Ratios are against bf16 seed 0, and for DHEN also against the anchor
(compiled bf16, 30.3-32.6 ms; /work/shared/anchors/README.md). LoKA rows carry the plan's
g (GEMM share of the step), s (pre-quantized FP8 GEMM speedup) and ceiling 1/((1-g)+g/s).

    python bench/e2e.py --smoke                     # CPU, tiny presets, under a minute
    python bench/e2e.py                             # GPU, the four large models, ~8 min
    python bench/e2e.py --models dhen --steps 300 --compile
Results: e2e_<mode>_<utc time>.json (metadata, every run, plans' summaries) and .csv (one
row per model and variant) in --out (default $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import time
import traceback
from pathlib import Path

from harness import Budget, metadata, parser, stamp, write_csv, write_json

ANCHOR_DHEN_MS = (30.3, 32.6)
VARIANTS = ("bf16", "bf16-seed1", "torchao-tensorwise", "torchao-tensorwise-auto",
            "torchao-rowwise", "torchao-rowwise-auto", "loka")  # fmt: skip
QUALITY_KEY = {"dlrm": "ne", "dhen": "ne", "wukong": "ne", "hstu": "ndcg@10"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)  # --out, --budget-s (the whole run: 480 s; smoke 35)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny presets, a few steps")
    p.add_argument(
        "--models", default=None, help="default: dlrm,dhen,wukong,hstu (smoke: dhen,hstu)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None, help="training steps per run (120)")
    p.add_argument("--probe-steps", type=int, default=None, help="LoKA's bf16 warm-up (40)")
    p.add_argument("--timed", type=int, default=None, help="last steps timed (40)")
    p.add_argument("--bench-budget-s", type=float, default=45.0, help="kernel bench per model")
    p.add_argument("--compile", action="store_true", help="torch.compile every variant")
    p.add_argument("--cache", default=None,
                   help="kernel_bench cache folder (default ~/.cache/loka, shared with dispatch_table.py)")  # fmt: skip
    p.add_argument("--seed-cache", default=None, metavar="TABLE",
                   help="a kernel_bench table measured on this machine's identity, stored into "
                   "the cache first (bench/dispatch_table.py's output), so plans start measured")  # fmt: skip
    args = p.parse_args(argv)
    smoke = args.smoke
    args.preset = "tiny" if smoke else "large"
    args.steps = args.steps or (4 if smoke else 120)
    args.probe_steps = args.probe_steps or (2 if smoke else 40)
    args.timed = min(args.timed or (2 if smoke else 40), args.steps - args.probe_steps)
    args.budget_s = args.budget_s or (35.0 if smoke else 480.0)
    args.models = args.models or ("dhen,hstu" if smoke else "dlrm,dhen,wukong,hstu")
    return args


# Set by main() from the command line; importing the script runs nothing.
ARGS = parse_args([])

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import polars as pl  # noqa: E402

import loka.zoo as zoo  # noqa: E402
from loka.dispatch import PlanConfig, Session, SessionConfig, apply, make_plan  # noqa: E402
from loka.probe import ProbeConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
AUTOCAST = torch.bfloat16 if GPU else None
BUDGET = Budget(None)


def over_budget() -> bool:
    return BUDGET.over()


def _timer():
    if GPU:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return start, end
    return None


def _elapsed_ms(fn) -> float:
    if GPU:
        start, end = _timer()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def torchao_model(setup, variant: str) -> int:
    """Convert `setup.model` with torchao float8 training; returns the number converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    recipe = "tensorwise" if "tensorwise" in variant else "rowwise"
    config = Float8LinearConfig.from_recipe_name(recipe)
    if variant.endswith("-auto"):
        keep = _auto_filter_for_recipe(recipe, filter_fqns=[])
    else:
        # All linears float8 hardware can run (K and N multiples of 16).
        def keep(mod, fqn):
            return (
                isinstance(mod, torch.nn.Linear)
                and mod.in_features % 16 == 0
                and (mod.out_features % 16 == 0)
            )

    convert_to_float8_training(setup.model, config=config, module_filter_fn=keep)
    return sum(type(m).__name__ == "Float8Linear" for m in setup.model.modules())


def evaluate(setup, model) -> dict[str, float]:
    model.eval()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=GPU):
        metrics = setup.metrics(model, setup.eval_batches())
    model.train()
    return {k: float(v) for k, v in metrics.items()}


def train_run(name: str, variant: str) -> dict:
    seed = 1 if variant == "bf16-seed1" else 0
    setup = zoo.create(name, ARGS.preset, device=DEVICE, seed=seed)
    row: dict = {"model": name, "variant": variant, "seed": seed, "fp8_layers": 0}
    session = None
    if variant.startswith("torchao"):
        if not GPU:
            return {**row, "skipped": "torchao float8 training needs a CUDA GPU"}
        row["fp8_layers"] = torchao_model(setup, variant)
    model = setup.model
    if ARGS.compile and variant != "loka":
        model = torch.compile(setup.model)
    if variant == "loka":
        probe = ProbeConfig(warmup_steps=ARGS.probe_steps, max_sites_per_step=None, warmup_every=max(1, ARGS.probe_steps // 8),
                            every=25, min_batches=min(5, max(2, ARGS.probe_steps // 8)))  # fmt: skip
        session = Session(setup.model, SessionConfig(
            warmup_steps=ARGS.probe_steps, probe=probe, cache_dir=ARGS.cache,
            bench_budget_s=ARGS.bench_budget_s), sample=next(setup.train_batches()))  # fmt: skip
    # The fused CUDA AdamW is what a speed-minded user runs; the default foreach kernels
    # took 18-26% of the bf16 step in the zoo baseline and would dilute every ratio.
    fused = next(setup.model.parameters()).is_cuda
    optimizer = torch.optim.AdamW(setup.model.parameters(), lr=1e-3, fused=fused)
    batches = setup.train_batches()
    times, losses = [], []
    for _step in range(ARGS.steps):
        batch = next(batches)
        loss_box = []

        def one_step(batch=batch, box=loss_box, model=model):
            box.append(zoo.training_step(setup, model, optimizer, batch, autocast_dtype=AUTOCAST,
                                         check_finite=False))  # fmt: skip

        times.append(_elapsed_ms(one_step))
        losses.append(float(loss_box[0]))
        if session is not None:
            session.step(loss_box[0])
            if ARGS.compile and session.phase == "applied" and model is setup.model:
                model = torch.compile(setup.model)
    timed = times[-ARGS.timed :]
    row |= {
        "step_ms": statistics.median(timed), "step_ms_p10": _q(timed, 0.1),
        "step_ms_p90": _q(timed, 0.9), "final_loss": losses[-1],
        "loss_finite": all(math.isfinite(v) for v in losses), "eval": evaluate(setup, model),
    }  # fmt: skip
    if session is not None:
        session.close()
        plan = session.plan
        s = plan.summary
        row |= {
            "fp8_layers": len(session.applied.sites) - len(session.applied.demoted),
            "plan": {k: v for k, v in s.__dict__.items()},
            "plan_fp8_passes": s.passes_fp8, "g": s.gemm_share, "s": s.prequant_speedup,
            "ceiling": s.ceiling, "predicted": s.predicted_speedup, "estimated": s.estimated,
            "guard_events": [e.__dict__ for e in session.guard.events] if session.guard else [],
            "session_events": session.events,
        }  # fmt: skip
        row["_tables"] = (session.tables, session.kernel_bench)
    row["_setup"] = setup
    return row


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def forward_ms(model, batch) -> float:
    model.eval()

    def fwd():
        with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=GPU):
            model(batch)

    if GPU:
        import triton.testing

        return float(triton.testing.do_bench(fwd, rep=200, return_mode="median"))
    return statistics.median(_elapsed_ms(fwd) for _ in range(3))


def inference_runs(name: str, bf16_row: dict, loka_row: dict | None) -> list[dict]:
    setup = bf16_row["_setup"]
    batch = next(setup.train_batches())
    # Inference runs on bf16 weights, as served (the anchor's setting), for every variant.
    served = copy.deepcopy(setup.model).to(torch.bfloat16 if GPU else torch.float32)
    weights = str(next(served.parameters()).dtype)
    try:
        base_ms = forward_ms(served, batch)
    except RuntimeError as exc:  # a model that does not run on bf16 weights: keep fp32
        served, weights = copy.deepcopy(setup.model), f"torch.float32 (bf16 failed: {exc})"
        base_ms = forward_ms(served, batch)
    rows = [{"model": name, "variant": "infer-bf16", "fwd_ms": base_ms, "weights": weights}]
    if GPU:
        try:
            from torchao.quantization import (
                Float8DynamicActivationFloat8WeightConfig,
                PerRow,
                quantize_,
            )

            quantized = copy.deepcopy(served)
            quantize_(quantized, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            rows.append({"model": name, "variant": "infer-torchao-rowwise",
                         "fwd_ms": forward_ms(quantized, batch)})  # fmt: skip
            del quantized
        except Exception as exc:
            rows.append({"model": name, "variant": "infer-torchao-rowwise", "error": repr(exc)})
    if loka_row is not None and "_tables" in loka_row:
        tables, bench = loka_row["_tables"]
        plan = make_plan(tables["sites"], tables["site_errors"], bench, PlanConfig(inference=True))
        model = copy.deepcopy(served)
        applied = apply(model, plan, sample=batch)
        s = plan.summary
        rows.append({"model": name, "variant": "infer-loka", "fwd_ms": forward_ms(model, batch),
                     "fp8_layers": len(applied.sites), "predicted": s.gemm_speedup,
                     "estimated": s.estimated})  # fmt: skip
        del model
    base = rows[0]["fwd_ms"]
    for r in rows:
        if "fwd_ms" in r:
            r["speedup_vs_bf16"] = base / r["fwd_ms"]
    return rows


def run_metadata() -> dict:
    return metadata(
        DEVICE, mode="smoke" if ARGS.smoke else "full", date_utc=stamp(),
        compiled=ARGS.compile, steps=ARGS.steps, probe_steps=ARGS.probe_steps,
        timed_steps=ARGS.timed, preset=ARGS.preset,
        timing="median CUDA-event time of training_step over the last timed steps; "
        "inference: triton.testing.do_bench median of one forward",
        anchor_dhen_compiled_bf16_ms=ANCHOR_DHEN_MS,
    )  # fmt: skip


def seed_cache(table_path: str) -> str:
    """Store a recorded kernel_bench table into the cache when it was measured on a machine
    of this one's identity (GPU, capability, driver, torch, triton); says what it did."""
    from loka.dispatch.bench.cache import BenchCache
    from loka.dispatch.device import DeviceInfo
    from loka.schema import read_table

    device = DeviceInfo.current()
    table = read_table(table_path, "kernel_bench").filter(~pl.col("estimated"))
    try:
        path = BenchCache(ARGS.cache).store(device, table)
    except Exception as exc:  # another machine identity: the run measures from scratch
        return f"not seeded from {table_path}: {exc}"
    return f"seeded {path} with {table.height} measured rows from {table_path}"


def main(argv: list[str] | None = None) -> None:
    global ARGS, BUDGET
    ARGS = parse_args(argv)
    BUDGET = Budget(ARGS.budget_s)
    out = Path(ARGS.out)
    meta = run_metadata()
    if ARGS.seed_cache:
        meta["seed_cache"] = seed_cache(ARGS.seed_cache)
        print(f"[e2e] {meta['seed_cache']}", flush=True)
    runs: list[dict] = []
    variants = [v for v in ARGS.variants.split(",") if v]
    for name in ARGS.models.split(","):
        model_rows = {}
        for variant in variants:
            if over_budget():
                runs.append({"model": name, "variant": variant, "skipped": "over the time budget"})
                continue
            print(f"[e2e] {name} {variant} ...", flush=True)
            try:
                row = train_run(name, variant)
            except Exception as exc:
                row = {"model": name, "variant": variant, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
            model_rows[variant] = row
            runs.append(row)
        if "bf16" in model_rows and "_setup" in model_rows["bf16"] and not over_budget():
            try:
                runs += inference_runs(name, model_rows["bf16"], model_rows.get("loka"))
            except Exception as exc:
                runs.append({"model": name, "variant": "infer", "error": repr(exc)})
        for row in model_rows.values():
            row.pop("_setup", None)
            row.pop("_tables", None)
        model_rows.clear()
        gc.collect()
        if GPU:
            torch.cuda.empty_cache()
    summarize(runs)
    stamp = meta["date_utc"]
    mode = meta["mode"]
    write_json(out / f"e2e_{mode}_{stamp}.json", {"meta": meta, "runs": runs})
    fields = ["model", "variant", "seed", "fp8_layers", "step_ms", "step_ms_p10", "step_ms_p90",
              "speedup_vs_bf16", "vs_anchor", "quality", "quality_in_band", "quality_ok", "final_loss",
              "fwd_ms", "g", "s", "ceiling", "predicted", "estimated", "skipped", "error"]  # fmt: skip
    write_csv(out / f"e2e_{mode}_{stamp}.csv", runs, fields)
    print(f"wrote {out}/e2e_{mode}_{stamp}.json and .csv ({BUDGET.elapsed():.0f} s)")


def summarize(runs: list[dict]) -> None:
    by_model: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    print(f"\n== LoKA end to end ({'compiled' if ARGS.compile else 'eager'}, {ARGS.preset}, "
          f"{ARGS.steps} steps, {DEVICE}) ==")  # fmt: skip
    head = f"{'model':<7} {'variant':<24} {'fp8':>4} {'step ms':>8} {'x bf16':>7} {'quality':>8} {'ok':>5} {'fwd ms':>7} {'x bf16':>7}  g / s / ceiling"
    print(head)
    for name, rows in by_model.items():
        base = rows.get("bf16", {})
        key = QUALITY_KEY.get(name, "ne")
        band = [rows[v]["eval"].get(key) for v in ("bf16", "bf16-seed1")
                if v in rows and "eval" in rows[v]]  # fmt: skip
        lo, hi = (min(band), max(band)) if band else (math.nan, math.nan)
        for variant, r in rows.items():
            if "step_ms" in r and "step_ms" in base:
                r["speedup_vs_bf16"] = base["step_ms"] / r["step_ms"]
            if name == "dhen" and "step_ms" in r:
                r["vs_anchor"] = sum(ANCHOR_DHEN_MS) / 2 / r["step_ms"]
            if "eval" in r:
                r["quality"] = r["eval"].get(key)
                # Within the spread of the bf16 seeds, or better than both (lower NE is
                # better, higher NDCG is better): FP8 must not cost quality.
                r["quality_in_band"] = bool(band) and lo - 1e-12 <= r["quality"] <= hi + 1e-12
                r["quality_ok"] = bool(band) and (
                    r["quality"] <= hi + 1e-12 if key == "ne" else r["quality"] >= lo - 1e-12
                )
            extra = ""
            if variant == "loka" and r.get("ceiling") is not None:
                extra = f"{r['g']:.2f} / {r['s']:.2f} / {r['ceiling']:.2f}"
            status = r.get("skipped") or r.get("error", "")[:60]
            print(f"{name:<7} {variant:<24} {r.get('fp8_layers', ''):>4} "
                  f"{_f(r.get('step_ms')):>8} {_f(r.get('speedup_vs_bf16'), '{:.2f}'):>7} "
                  f"{_f(r.get('quality'), '{:.4f}'):>8} {r.get('quality_ok', '')!s:>5} "
                  f"{_f(r.get('fwd_ms')):>7} {_f(r.get('speedup_vs_bf16') if 'fwd_ms' in r else None, '{:.2f}'):>7}  "
                  f"{extra}{status}")  # fmt: skip
    print("aims: LoKA training >= 1.2x bf16 and ahead of torchao's best, quality no worse than the bf16 seeds' "
          "band; inference >= 1.4x bf16")  # fmt: skip


def _f(value, fmt: str = "{:.2f}") -> str:
    return (
        ""
        if value is None or (isinstance(value, float) and math.isnan(value))
        else fmt.format(value)
    )


if __name__ == "__main__":
    main()
