"""Realized speed: the real training step of a LoKA plan against bf16, A/B in one process.

Per zoo model (`large` presets by default, `zoo.make_optimizer`: fused AdamW, and row-wise
Adagrad on the tables of presets with sparse embeddings such as `xl`; bf16 autocast) and execution mode (`eager`,
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
5. With `--verify`, LoKA's plan first goes through Dispatch's closed-loop verification
   (`loka.dispatch.verify`) on the same step, so that the blocks time the verified plan.
6. Quality (`--quality-steps N`): fresh models (bf16 seeds 0, 1, 2, timed variants or not,
   and LoKA's final plan: the applied plan less what verification demoted) train N steps in
   the same mode on the same fresh batches (none cycled), one at a time, then eval on the
   same held-out batches (NE for CTR models, NDCG@10 for HSTU); `quality_ok`: not worse
   than the bf16 seeds' band; `quality_vs_own_seed`: the difference from the bf16 seed the
   variant started from (``loka@seed=1`` trains the plan from seed 1's init and batches, so a
   plan is judged seed by seed, not on one draw); each draw's training loss goes with it
   (`loss_curve`, `loss_max_rise`: a divergence tells from a drift). The timed models are not used (verification gives LoKA's more
   steps, over a few cycled batches) and all but bf16's are freed first: time only
   `bf16,loka` where four timed xl models do not fit (InterFormer's did not).
7. Inference (`--inference`): the bf16 seed-0 model's weights served in bf16, forward only,
   in the same mode, interleaved blocks: `infer-bf16`, `infer-torchao-rowwise` (dynamic
   FP8, torchao), `infer-loka` (`PlanConfig(inference=True, mode=mode)`). Both FP8 variants
   serve weights quantized once: torchao's `quantize_` stores FP8 weights, and `apply` of an
   inference plan prequantizes every native FP8 site's weight (`ApplyConfig.prequantize_weights`),
   so a served forward quantizes only its inputs without inductor freezing. With
   `--verify`, each infer-loka plan first goes through Dispatch's verification on the
   served forward (compiled as timed; a demoted site serves bf16), and the served-output
   error is that of the verified plan.
   `--infer-freezing on` freezes every served model as well (weights, embedding tables
   included, become constants; Wukong xl's frozen compile at 16k outlasted two 10-minute
   calls). `--infer-batch 16384,65536` serves at those batch sizes (training batches
   stacked, jagged ones joined; rows carry `batch_size`); the inference plan is made from
   the kernel timings at the training shapes (at the training batch, infer-loka's
   `predicted_from_step` is bf16's forward less the kernel time the plan saves, and its
   `g` the share of bf16's forward the linears' GEMMs take by kernel times). The training rows are on
   disk before serving starts, which begins only with the time its compiles need left
   (`inference_need_s`). `--infer-variants loka` serves LoKA alone beside bf16 (torchao's
   serving compile took 276 s at DHEN xl). At the xl presets give serving a call of its own:
   `--variants bf16 --inference --infer-variants loka --infer-batch 16384`.
   `--infer-variants loka,loka-off` also times the plan applied and switched off (every
   site its original module, as verification's bf16 blocks run it) against the separate
   bf16 model: whether verification's reference is bf16's twin in speed.
On a machine without a GPU (`--device cpu`, implied there) it runs the tiny presets as a
smoke test of the script itself (a `--preset` given is honoured, slowly); its times say
nothing of GPU speed.

    python bench/realized.py --models dhen --modes compiled,eager
Results: realized_<utc>.json under --out (default $OUT, else bench/results/): metadata,
every row (model, preset, mode, dynamic, variant, step_ms or fwd_ms, blocks,
speedup_vs_bf16 (against seed 0), speedup_vs_bf16_seeds (against the median of the timed
bf16 seeds), ratio spread, grad_ok, quality and quality_ok with --quality-steps,
vs_anchor where a recorded anchor exists, and for LoKA predicted_speedup, ceiling, g, s,
g_step, ceiling_step and safe_ceiling_step (the ceilings with g the plan's bf16 GEMM
kernel time over this run's bf16 step: `PlanSummary.ceiling_from_step`),
sites, passes, demoted), the plans' summaries. This is the project's end-to-end benchmark
(it replaced bench/e2e.py, which ran variants one after another; its results stay recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

MODES = ("eager", "compiled", "cudagraphs")
VARIANTS = ("bf16", "bf16-seed1", "bf16-seed2", "torchao-tensorwise-auto",
            "torchao-rowwise-auto", "loka")  # fmt: skip


# The recorded bf16 steps this bench is held against (/work/shared/anchors/README.md: a
# DHEN-style model like the zoo's DHEN large, compiled, B=16384, three seeds; H200):
# (model, preset, mode) -> the band in ms. Rows of that model and mode get `vs_anchor`.
ANCHORS = {("dhen", "large", "compiled"): (30.3, 32.6)}

_T0 = time.monotonic()
MIN_BLOCKS = 3
# Serving is three more compiled models (bf16, torchao, LoKA): started with less left, a run
# overran the device's per-call limit and lost every row it had timed. At Wukong xl, where a
# training variant took 35-50 s to compile, serving at B=16384 had not finished after 230 s
# (twice): so the need also scales with the slowest training compile this run saw.
INFERENCE_MIN_S = 150
SERVED_MODELS = 3
SERVING_COMPILE_FACTOR = 1.5
# Without freezing and without torchao, a served model compiled in 0.2-0.45x the slowest
# training variant's warm-up (DHEN xl 6 / 12 s, Wukong xl 6 / 5 s; realized_20261202T172746Z,
# ..172925Z); torchao's rowwise serving compile took 276 s at DHEN xl (..170805Z).
LIGHT_SERVING_MIN_S = 45
LIGHT_SERVING_FACTOR = 0.75


# `loka-off`: the plan applied, then every site switched back to its original module
# (`Applied.use(set())`), as verification's bf16 blocks run it: timed beside the separate
# bf16 model, it shows whether the switched-back model is that model's twin in speed
# (InterFormer large, CUDA graphs: verification measured 1.005x, the final blocks 0.999x).
INFER_VARIANTS = ("torchao", "loka", "loka-off")
PROFILE_STEPS = 4  # steps each profile covers


def infer_variants(text: str) -> tuple[str, ...]:
    """`--infer-variants` as a tuple; one line naming an unknown variant."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in names if v not in INFER_VARIANTS and not v.startswith("loka+")]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown serving variant(s) {unknown}; choose from {', '.join(INFER_VARIANTS)} "
            "or loka+OPTIONS with `ApplyConfig` options (bias=) or static="
        )
    for name in names:
        if name.startswith("loka+"):
            try:
                plan_opts, _ = split_options(loka_options(name))
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            if plan_opts:  # a serving variant shares the one inference plan
                raise argparse.ArgumentTypeError(
                    f"{name}: serving variants take ApplyConfig options only, not {sorted(plan_opts)}"
                )
    return names


def inference_need_s(rows: list[dict], served: int = SERVED_MODELS, light: bool = False) -> float:
    """Seconds a serving phase needs: each of the `served` models compiles about as long as
    the slowest training variant did (its gradient check or warm-up, whichever compiled
    it), times `SERVING_COMPILE_FACTOR`, plus the timed blocks; never less than
    `INFERENCE_MIN_S`. `light` (no freezing, no torchao): `LIGHT_SERVING_FACTOR` of it,
    never less than `LIGHT_SERVING_MIN_S`."""
    compiles = [r.get("grad_check_s", 0.0) + r.get("warmup_s", 0.0) for r in rows]
    slowest = max(compiles, default=0.0)
    if light:
        return max(LIGHT_SERVING_MIN_S, served * LIGHT_SERVING_FACTOR * slowest + 30.0)
    return max(INFERENCE_MIN_S, served * SERVING_COMPILE_FACTOR * slowest + 30.0)


def log(message: str) -> None:
    """A progress line with the seconds since start (where a GPU budget went)."""
    print(f"[realized {time.monotonic() - _T0:6.0f} s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="dhen")
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list; LoKA variants take options: loka+fast, loka+nohost, loka+min=1.15, loka+wq=1, loka+x=GLOB/pass, loka+bias=gemm; any variant takes model options of its own after @: bf16@attention=math")  # fmt: skip
    p.add_argument("--preset", default=None,
                   help="zoo preset (default: large on a GPU, tiny on the CPU, where any other "
                        "is honoured but slow)")  # fmt: skip
    p.add_argument("--model-options", default="", type=model_options,
                   help="model config fields for every variant, e.g. mixing=bmm (Wukong); "
                        "comma list of key=value, values parsed as Python literals")  # fmt: skip
    p.add_argument("--probe-steps", type=int, default=30)
    p.add_argument("--probe-every", type=int, default=None,
                   help="sample every Nth probe step for the error statistics (default: "
                        "probe-steps // 8); undecided sites need more sampled batches")  # fmt: skip
    p.add_argument("--warmup-steps", type=int, default=6, help="untimed steps per variant")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--batches", type=int, default=4, help="pre-generated batches, cycled")
    p.add_argument("--bench-budget-s", type=float, default=60.0)
    p.add_argument("--cache", default=None, help="kernel_bench cache folder")
    p.add_argument("--verify", action="store_true", help="run Dispatch's verification too")
    p.add_argument("--verify-unit", default="site", choices=("site", "pass"),
                   help="what verification switches and demotes (VerifyConfig.unit)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="profile bf16, FP8, serving")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after")
    p.add_argument("--inference", action="store_true", help="also time forward-only serving")
    p.add_argument("--infer-freezing", default="off", choices=("on", "off"),
                   help="inductor freezing of the served models (compiled modes): weights as "
                        "constants; off (default): the FP8 variants serve weights quantized "
                        "once (torchao's FP8 weights, LoKA's prequantized ones)")  # fmt: skip
    p.add_argument("--infer-variants", default="torchao,loka", type=infer_variants,
                   help="the FP8 variants served beside infer-bf16: comma list of torchao, "
                        "loka (torchao's rowwise serving compile took 276 s at DHEN xl), "
                        "loka-off (the plan applied and switched off: verification's "
                        "reference)")  # fmt: skip
    p.add_argument("--infer-batch", default=None,
                   help="serving batch sizes, comma list (multiples of the training batch; "
                        "HSTU counts sequences; default: the training batch)")  # fmt: skip
    p.add_argument(
        "--quality-steps",
        type=int,
        default=0,
        help="train fresh bf16 seeds and LoKA's final plan this long, then eval",
    )
    p.add_argument(
        "--quality-only",
        action="store_true",
        help="with --quality-steps: train and evaluate only, no timed models or blocks (an "
        "HSTU xl quality run then fits one device call)",
    )
    p.add_argument(
        "--dynamic", default="auto",
        help="comma list: auto (torch.compile's default: a shape that changes makes the graph "
             "dynamic) and/or static (dynamic=False: one specialized graph per shape); every "
             "variant of a run is compiled alike",
    )  # fmt: skip
    p.add_argument(
        "--inductor", default="", type=lambda text: key_values(text, "--inductor"),
        help="comma list of KEY=VALUE set on torch._inductor.config before anything compiles "
             "(e.g. triton.multi_kernel=1); every variant of the run compiles under them",
    )  # fmt: skip
    p.add_argument(
        "--no-grad-check", dest="grad_check", action="store_false",
        help="skip the gradient check (each seed-0 variant's gradients against bf16's)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.quality_only and args.quality_steps <= 0:
        p.error("--quality-only needs --quality-steps N (N > 0)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":  # a smoke test of the script: tiny models, few steps
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported
        args.preset = args.preset or "tiny"
        args.probe_steps = min(args.probe_steps, 4)
        args.warmup_steps = min(args.warmup_steps, 2)
        args.blocks, args.block_steps = min(args.blocks, 3), min(args.block_steps, 3)
    args.preset = args.preset or "large"
    return args


QUALITY_KEY = {"dlrm": "ne", "dhen": "ne", "wukong": "ne", "interformer": "ne", "hstu": "ndcg@10"}


class Clock:
    """Block timing: CUDA events (one sync per block) on a GPU, the host clock elsewhere."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def start(self):
        if self.cuda:
            a = self.torch.cuda.Event(enable_timing=True)
            a.record()
            return a
        return time.perf_counter()

    def elapsed_ms(self, mark) -> float:
        if self.cuda:
            b = self.torch.cuda.Event(enable_timing=True)
            b.record()
            b.synchronize()
            return mark.elapsed_time(b)
        return (time.perf_counter() - mark) * 1e3

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def interleaved(fns: dict, blocks: int, calls: int, clock: Clock, left) -> dict[str, list[float]]:
    """ms per call of each `fns[name]()`, per block; blocks interleave the names, the order
    rotating from block to block; at least `MIN_BLOCKS` of them (fewer only if asked)."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for block in range(blocks):
        order = names[block % len(names) :] + names[: block % len(names)]
        for name in order:
            mark = clock.start()
            for i in range(calls):
                fns[name](i)
            times[name].append(clock.elapsed_ms(mark) / calls)
        # Three blocks whatever the budget says (a block is seconds; a ratio from one block
        # has no spread and was once all a tight budget left); then the budget decides.
        if block >= MIN_BLOCKS - 1 and left() < 20:
            break
    return times


def quality_rows(rows: list[dict], key: str) -> None:
    """`quality` and `quality_ok` (not worse than the bf16 seeds' band) on each row."""
    band = [r["quality"] for r in rows if is_band_seed(r["variant"]) and "quality" in r]
    by_seed = {QUALITY_SEEDS[r["variant"]]: r["quality"] for r in rows
               if is_band_seed(r["variant"]) and "quality" in r}  # fmt: skip
    for r in rows:
        if "quality" not in r or not band:
            continue
        lo, hi = min(band), max(band)
        r["quality_band"] = (lo, hi)
        r["quality_ok"] = r["quality"] <= hi + 1e-12 if key == "ne" else r["quality"] >= lo - 1e-12
        if not is_band_seed(r["variant"]) and (own := by_seed.get(r.get("seed", 0))) is not None:
            # The same init and batches in bf16: what the variant itself changed, where the
            # band only says how far apart different inits land.
            r["quality_vs_own_seed"] = r["quality"] - own


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
    import torch._inductor.config as inductor_config

    for key, value in args.inductor.items():
        *path, name = key.split(".")
        owner = inductor_config
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            raise SystemExit(f"--inductor: torch._inductor.config has no {key!r}")
        setattr(owner, name, value)
    from harness import git_commit, stamp, write_json

    import loka.zoo as zoo
    from loka.probe import DENSE_HOST_ERROR_MAX_SIZE, Probe, ProbeConfig

    start = time.monotonic()
    device = args.device
    gpu = device == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date_utc": stamp(), "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(), "cuda": torch.version.cuda,
        "preset": args.preset, "blocks": args.blocks, "block_steps": args.block_steps,
        "inductor": args.inductor,
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
    # The profile tables beside the run's JSON, in a folder of the same stamp.
    args.profile_dir = out / f"realized_{meta['date_utc']}_profiles"
    rows: list[dict] = []
    plans: dict = {}
    variants = [v for v in args.variants.split(",") if v]
    if meta["torchao"] is None:
        variants = [v for v in variants if not v.startswith("torchao")]
    for v in variants:
        variant_seed(*split_variant(v))  # a malformed ``@`` option stops the run here
        # A bad option fails here, before any GPU time is spent.
        if v.startswith("loka") and any(
            k in SERVING_OPTIONS for k in loka_options(split_variant(v)[0])
        ):
            raise SystemExit(f"{v}: static= is a serving option (--infer-variants)")

    def left() -> float:
        return args.budget_s - (time.monotonic() - start)

    for name in args.models.split(","):
        if left() < 60:
            rows.append({"model": name, "skipped": "over the time budget"})
            continue
        # -- probe once ---------------------------------------------------------------
        setup = zoo.create(name, args.preset, device=device, seed=0, **args.model_options)
        batches = [b for b, _ in zip(setup.train_batches(), range(args.batches), strict=False)]
        P = args.probe_steps
        every = args.probe_every or max(1, P // 8)
        probe = Probe(setup.model, ProbeConfig(
            warmup_steps=P, max_sites_per_step=None, warmup_every=every, every=25,
            min_batches=min(5, max(2, P // every)), queue_size=P,
            host_error_max_size=DENSE_HOST_ERROR_MAX_SIZE))  # fmt: skip
        opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3, fused=gpu))
        for i in range(P):
            zoo.training_step(setup, setup.model, opt, batches[i % len(batches)],
                              autocast_dtype=torch.bfloat16 if gpu else None,
                              check_finite=False)  # fmt: skip
            probe.step()
        tables = probe.tables()
        probe.detach()
        del setup, opt, probe
        gc.collect()
        log(f"{name}: probed {P} steps")
        for mode in args.modes.split(","):
            if left() < 45:
                rows.append({"model": name, "mode": mode, "skipped": "over the time budget"})
                continue
            for dynamic in args.dynamic.split(",") if mode != "eager" else ["auto"]:
                if left() < 45:
                    rows.append({"model": name, "mode": mode, "dynamic": dynamic,
                                 "skipped": "over the time budget"})  # fmt: skip
                    continue

                def tagged(new, dynamic=dynamic):
                    tags = {"dynamic": dynamic, "preset": args.preset}
                    if args.model_options:
                        tags["model_options"] = args.model_options
                    return [r | tags for r in new]

                def save(new, tagged=tagged, done=rows):  # training rows, before serving
                    write_json(out / f"realized_{meta['date_utc']}.json",
                               {"meta": meta | {"partial": True}, "runs": done + tagged(new),
                                "plans": plans})  # fmt: skip

                try:
                    new = run_mode(args, name, mode, variants, tables, plans, left, dynamic,
                                   save=save)  # fmt: skip
                    rows += tagged(new)
                except Exception as exc:
                    rows.append({"model": name, "mode": mode, "dynamic": dynamic,
                                 "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
                    print(rows[-1]["traceback"])
                # What is timed so far, on disk now: a run killed later keeps these rows.
                write_json(out / f"realized_{meta['date_utc']}.json",
                           {"meta": meta | {"partial": True}, "runs": rows, "plans": plans})  # fmt: skip
                free_device_memory()
                torch._dynamo.reset()

    for r in rows:
        anchor = ANCHORS.get((r.get("model"), args.preset, r.get("mode")))
        if anchor and r.get("step_ms"):
            r["vs_anchor"] = (anchor[0] / r["step_ms"], anchor[1] / r["step_ms"])
    meta["anchors_ms"] = {"/".join(k): v for k, v in ANCHORS.items()}
    path = out / f"realized_{meta['date_utc']}.json"
    write_json(path, {"meta": meta, "runs": rows, "plans": plans})
    print(f"\n== realized step speed ({args.preset}) ==")
    print(f"{'model':<7} {'mode':<10} {'variant':<24} {'fp8':>4} {'ms':>8} {'x bf16':>7} "
          f"{'ratio min..max':>15} {'pred':>6} {'pstep':>6} {'ceil':>6} {'safe':>6} "
          f"{'cstep':>6} {'sstep':>6} {'quality':>8}")  # fmt: skip
    for r in rows:
        if r.get("batch_size") and str(r.get("variant", "")).startswith("infer"):
            r = r | {"variant": f"{r['variant']}@{r['batch_size']}"}  # the console's name only
        if "step_ms" not in r and "fwd_ms" not in r:
            what = r.get("skipped") or r.get("error", "")[:80]
            if not what and "quality" in r:
                what = f"not timed; quality {r['quality']:.4f}"
                what += "" if r.get("quality_ok", True) else "!"
                if (delta := r.get("quality_vs_own_seed")) is not None:
                    what += f" ({delta:+.4f} against bf16 seed {r.get('seed', 0)})"
            print(f"{r.get('model', ''):<7} {r.get('mode', ''):<10} {r.get('variant', ''):<24} "
                  f"{what}")  # fmt: skip
            continue
        pred = r.get("predicted_speedup")
        pstep, ceil, safe, cstep, sstep = (
            "" if r.get(k) is None else f"{r[k]:.3f}"
            for k in ("predicted_from_step", "ceiling", "safe_ceiling", "ceiling_step",
                      "safe_ceiling_step")
        )  # fmt: skip
        quality = (
            ""
            if "quality" not in r
            else f"{r['quality']:.4f}{'' if r.get('quality_ok', True) else '!'}"
        )
        print(f"{r['model']:<7} {r['mode']:<10} {r['variant']:<24} {r.get('fp8_layers', ''):>4} "
              f"{r.get('step_ms', r.get('fwd_ms')):>8.2f} {r['speedup_vs_bf16']:>7.3f} "
              f"{r['ratio_min']:>7.3f}..{r['ratio_max']:<7.3f} "
              f"{'' if pred is None else f'{pred:.3f}':>6} {pstep:>6} {ceil:>6} {safe:>6} "
              f"{cstep:>6} {sstep:>6} {quality:>8}")  # fmt: skip
    print(f"wrote {path} ({time.monotonic() - start:.0f} s)")


def run_mode(
    args, name, mode, variants, tables, plans, left, dynamic="auto", save=None
) -> list[dict]:
    """One mode's variants: timed training blocks, then (`--inference`) serving. `save` gets
    the training rows before serving starts: a serving compile that outlasts the device's
    limit (Wukong xl's did, at 16k) must not take the timed steps with it."""
    import torch

    import loka.zoo as zoo
    from loka.dispatch import PlanConfig, apply, make_plan
    from loka.dispatch.apply_plan import ApplyConfig
    from loka.dispatch.bench import (
        BenchCache,
        CostModel,
        benchmark,
        site_producer_shapes,
        site_recipes,
        site_shapes,
    )
    from loka.dispatch.bench.runner import mode_backends

    device = args.device
    gpu = device == "cuda"
    autocast = torch.bfloat16 if gpu else None
    clock = Clock(device)
    # Every variant (and every set of sites verification tries) is one more compiled
    # version of the same forward code: above dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 64
    sites = tables["sites"]
    options = {v: loka_options(split_variant(v)[0]) for v in variants if v.startswith("loka")}
    bench = benchmark(
        site_shapes(sites), device=device, cache=BenchCache(args.cache),
        cost_model=CostModel.shipped(), budget_s=args.bench_budget_s,
        backends=mode_backends(mode), recipes=site_recipes(tables["site_errors"]),
        producer_shapes=site_producer_shapes(sites) if mode != "eager" else (),
        include_fast_accum=any(o.get("allow_fast_accum") for o in options.values()),
        # Candidates whose host time alone loses are skipped only when every plan charges it.
        charge_host=mode == "eager" and all(o.get("charge_host", True) for o in options.values()),
    )  # fmt: skip
    log(f"{name}/{mode}: bench {bench.measured} measured, {bench.reused} cached "
        f"({bench.retimed} bf16 baselines and {bench.retimed_fp8} FP8 GEMMs re-timed), "
        f"{bench.estimated} estimated")  # fmt: skip
    for note in bench.notes:
        log(f"{name}/{mode}: bench: {note}")
    loka_plans, loka_apply = {}, {}
    for variant, opts in options.items():
        plan_opts, apply_opts = split_options(opts)
        plan = make_plan(sites, tables["site_errors"], bench.table,
                         PlanConfig(mode=mode, **plan_opts))  # fmt: skip
        loka_plans[variant], loka_apply[variant] = plan, ApplyConfig(**apply_opts)
        s = plan.summary
        key = f"{name}/{mode}/{dynamic}" + ("" if variant == "loka" else f"/{variant}")
        plans[key] = plan_record(plan) | {"bench_notes": bench.notes, "options": opts}
        log(f"{name}/{mode}: {variant} plan {s.sites_fp8} sites / {s.passes_fp8} passes, "
            f"predicted {s.predicted_speedup}, ceiling {s.ceiling}")  # fmt: skip
        if s.undecided_stakes:
            # What a Session would probe on for (`SessionConfig.decide_steps`); here the
            # probe is --probe-steps / --probe-every, fixed: pass more to decide them.
            log(f"{name}/{mode}: {variant} undecided that would change the plan: "
                f"{s.stakes_line()}")  # fmt: skip

    if args.quality_only:
        rows = [plan_row(name, mode, v, loka_plans.get(v)) for v in variants]
        quality_phase(args, rows, name, mode, dynamic, loka_plans, loka_apply)
        return rows
    if gpu:
        check_memory(name, args.preset, variants)
    made: dict[str, dict] = {}
    for variant in variants:
        base, extra = split_variant(variant)
        seed = variant_seed(base, extra)
        setup = zoo.create(name, args.preset, device=device, seed=seed,
                           **(args.model_options | extra))  # fmt: skip
        row = {"model": name, "mode": mode, "variant": variant, "seed": seed, "fp8_layers": 0,
               "embedding_update": zoo.embedding_update(setup.model)}  # fmt: skip
        if extra:
            row["variant_model_options"] = extra
        if variant.startswith("torchao"):
            if not gpu:
                continue  # torchao's float8 training needs a CUDA GPU
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
            if row["fp8_layers"] == 0:
                # Nothing converted: the same model as bf16, not worth a compile and blocks.
                row["skipped"] = "no layer passed torchao's auto filter: the bf16 model"
                made[variant] = {"row": row}
                continue
        applied = None
        if variant in loka_plans:
            applied = apply(setup.model, loka_plans[variant], loka_apply[variant])
            s = loka_plans[variant].summary
            row |= {"fp8_layers": len(applied.sites), "predicted_speedup": s.predicted_speedup,
                    "ceiling": s.ceiling, "safe_ceiling": s.safe_ceiling, "g": s.gemm_share,
                    "unconstrained": s.unconstrained_speedup,
                    "s": s.prequant_speedup,
                    "passes_fp8": s.passes_fp8, "demoted": {},
                    "plan_options": options[variant]}  # fmt: skip
        model = setup.model
        if mode != "eager":
            model = torch.compile(setup.model, **compile_kwargs(mode, dynamic, variant))
        opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3, fused=gpu))
        made[variant] = {"setup": setup, "model": model, "opt": opt, "row": row,
                         "applied": applied}  # fmt: skip
    batches = [b for b, _ in zip(made["bf16"]["setup"].train_batches(), range(args.batches),
                                 strict=False)]  # fmt: skip
    cudagraphs = mode == "cudagraphs"

    def step_fn(v, i):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        v["steps"] = v.get("steps", 0) + 1
        return zoo.training_step(v["setup"], v["model"], v["opt"], batches[i % len(batches)],
                                 autocast_dtype=autocast, check_finite=False)  # fmt: skip

    from torch._dynamo.utils import counters

    if args.grad_check:
        gradient_check(made, batches[0], autocast, cudagraphs)
    for v in made.values():
        if {"skipped", "error"} & v["row"].keys():
            continue
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.monotonic()
        try:
            for i in range(warmup_steps(args.warmup_steps, len(batches), cudagraphs)):
                step_fn(v, i)
            clock.sync()
        except Exception as exc:
            failed(v["row"], exc)
            print(v["row"]["traceback"])
        v["row"]["warmup_s"] = time.monotonic() - t0
        # Graphs dynamo built while warming up (every input shape of the cycled batches):
        # more than one means recompiles (a dynamic graph, or one graph per shape).
        v["row"]["graphs"] = built = counters["stats"]["unique_graphs"] - graphs
        v["row"] |= device_memory_gb()  # held so far (this and the earlier variants), peak
        log(f"{name}/{mode}/{v['row']['variant']}: warmed up in {v['row']['warmup_s']:.0f} s"
            + (f", {v['row']['held_gb']:.0f} GB held" if "held_gb" in v["row"] else "")
            + (f"; WARNING {built} graphs (graph breaks or recompiles: rerun with "
               "TORCH_LOGS=graph_breaks,recompiles)" if built > MAX_EXPECTED_GRAPHS else ""))  # fmt: skip
    live = [k for k, v in made.items() if "error" not in v["row"] and "skipped" not in v["row"]]
    for variant in loka_plans:
        if args.verify and variant in live:
            # The closed loop first, so that the blocks below time the plan it settled on.
            made[variant]["row"] |= verify_loka(
                lambda i, v=made[variant]: step_fn(v, i), made[variant]["applied"],
                args.verify_unit, mode,
            )  # fmt: skip
            row = made[variant]["row"]
            log(f"{name}/{mode}/{variant}: verified in {row['verify_s']:.0f} s, "
                f"{row['fp8_layers']} sites kept, {len(row['demoted'])} demoted")  # fmt: skip
    fns = {k: (lambda i, v=made[k]: step_fn(v, i)) for k in live}
    times = interleaved(fns, args.blocks, args.block_steps, clock, left)
    log(f"{name}/{mode}: timed {len(fns)} variant(s)")
    if times.get("bf16"):  # on the console now: a run killed later still leaves its numbers
        base_ms = statistics.median(times["bf16"])
        for variant, blocks in times.items():
            if blocks:
                ms = statistics.median(blocks)
                log(f"{name}/{mode}/{variant}: {ms:.2f} ms, {base_ms / ms:.3f}x bf16")
    if args.profile:
        # bf16 seed 0 and every FP8 variant (torchao's too: where it beats a plan, the
        # kernels side by side say why); the other bf16 seeds add nothing.
        for variant in live:
            if not variant.startswith("bf16-seed"):
                row = made[variant]["row"]
                try:  # a failed profile must not lose the timed blocks above
                    row["profile"] = profile(made[variant], step_fn, out=args.profile_dir,
                                             tag=f"{name}_{mode}_{variant}")  # fmt: skip
                    row["saved"] = saved_for_backward(made[variant], step_fn)
                except Exception as e:  # recorded in the row; the run goes on
                    row["profile_error"] = f"{type(e).__name__}: {e}"
        bf16_profile = made.get("bf16", {}).get("row", {}).get("profile")
        for variant, plan in loka_plans.items():
            row = made.get(variant, {}).get("row", {})
            if bf16_profile and row.get("profile"):
                row["prediction_parts"] = prediction_parts(
                    plan, bench.table, args.profile_dir, bf16_profile["table"],
                    row["profile"]["table"],
                )  # fmt: skip
    rows = []
    base = times.get("bf16")
    for variant, v in made.items():
        row = v["row"]
        if variant in times and times[variant] and base:
            row |= {"step_ms": statistics.median(times[variant]), "blocks_ms": times[variant],
                    **block_stats(base, times[variant])}  # fmt: skip
            if variant in loka_plans:
                row["predicted_from_step"] = predicted_from_step(
                    loka_plans[variant], row.get("demoted", {}), statistics.median(base)
                )
                row |= step_ceilings(loka_plans[variant].summary, statistics.median(base))
        if "error" not in row and "skipped" not in row:
            row["steps_timed"] = v.get("steps", 0)
        if v.get("model") is not None and (graphs := eager_graph_stats(v["model"])):
            row["eager_graphs"] = graphs
            log(f"{name}/{mode}/{variant}: eager graphs {graphs}")
        rows.append(row)
    if args.quality_steps > 0 and left() > 60:
        # The timed models other than bf16's (which serving reuses) go first: four timed
        # InterFormer xl models and a fresh one do not fit an H200.
        release_timed(made, keep="bf16")
        quality_phase(args, rows, name, mode, dynamic, loka_plans, loka_apply)
    band = [r["speedup_vs_bf16"] for r in rows if is_band_seed(r["variant"]) and "speedup_vs_bf16" in r]  # fmt: skip
    seeds_ms = [r["step_ms"] for r in rows if is_band_seed(r["variant"]) and "step_ms" in r]
    for r in rows:
        r["bf16_band"] = (min(band), max(band)) if band else None
        if seeds_ms and r.get("step_ms"):  # issue 14's table: against the seeds' median
            r["speedup_vs_bf16_seeds"] = statistics.median(seeds_ms) / r["step_ms"]
    if save is not None and args.inference:
        save(rows)
    for size in serving_sizes(args.infer_batch) if args.inference and "bf16" in made else []:
        where = {"model": name, "mode": mode, "variant": "infer"}
        light = args.infer_freezing == "off" and "torchao" not in args.infer_variants
        if left() <= (need := inference_need_s(rows, 1 + len(args.infer_variants), light)):
            rows.append(where | {"batch_size": size, "skipped": f"over the time budget "
                                 f"({left():.0f} s left, about {need:.0f} s needed)"})  # fmt: skip
            continue
        log(f"{name}/{mode}: inference" + (f" at B={size}" if size else ""))
        try:
            pool = serving_pool(batches, size, made["bf16"]["setup"].train_batches)
            batch = serving_batch(pool, size)
            del pool
            # How many training batches the served one holds: the kernel times the plan was
            # made from are scaled by it where the two differ.
            at_plan_shapes = batch_rows(batch) / batch_rows(batches[0])
            new = inference_rows(args, name, mode, made["bf16"]["setup"], tables, bench,
                                 batch, clock, left, dynamic, at_plan_shapes, plans)  # fmt: skip
            rows += [r | {"batch_size": size or batch_rows(batch)} for r in new]
        except Exception as exc:
            rows.append(where | {"batch_size": size, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                 "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
    made.clear()
    return rows


def device_memory_gb() -> dict[str, float]:
    """GB the process holds on the GPU now (`held_gb`) and at most so far (`peak_gb`): what
    `check_memory`'s estimate can be held to; empty on the CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"held_gb": torch.cuda.memory_allocated() / 1e9,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9}  # fmt: skip


def quality_phase(args, rows, name, mode, dynamic, loka_plans, loka_apply) -> None:
    """Each bf16 seed (a row added for one not among `rows`) and each LoKA plan trained
    fresh, one at a time, then evaluated: `quality`, and `quality_ok` against the seeds'
    band, on the rows."""
    key = QUALITY_KEY.get(name, "ne")
    rows += quality_only_rows(rows, name, mode)
    for r in rows:
        variant = r["variant"]
        if variant in QUALITY_SEEDS or (variant in loka_plans and "error" not in r):
            plan = loka_plans.get(variant)
            demoted = r.get("demoted", {})
            r["eval"] = train_and_evaluate(args, name, mode, variant, plan, demoted,
                                           dynamic, loka_apply.get(variant))  # fmt: skip
            free_device_memory()  # the fresh model's, before the next
            r["quality"] = r["eval"].get(key)
            r["quality_steps"] = args.quality_steps
            for field in ("loss_curve", "loss_max_rise", "loss_max_rise_step", "loss_last"):
                if field in r["eval"]:
                    r[field] = r["eval"].pop(field)
    quality_rows(rows, key)


def plan_row(name: str, mode: str, variant: str, plan) -> dict:
    """An untimed row of `variant` (`--quality-only`): with its plan's summary for LoKA's."""
    row = {"model": name, "mode": mode, "variant": variant, "timed": False,
           "seed": variant_seed(*split_variant(variant))}  # fmt: skip
    if plan is not None:
        s = plan.summary
        row |= {"fp8_layers": s.sites_fp8, "passes_fp8": s.passes_fp8,
                "predicted_speedup": s.predicted_speedup, "ceiling": s.ceiling,
                "safe_ceiling": s.safe_ceiling}  # fmt: skip
    return row


def quality_only_rows(rows: list[dict], name: str, mode: str) -> list[dict]:
    """A row for each bf16 seed of the quality band that was not a timed variant."""
    timed = {r.get("variant") for r in rows}
    return [{"model": name, "mode": mode, "variant": seed, "timed": False}
            for seed in QUALITY_SEEDS if seed not in timed]  # fmt: skip


def release_timed(made: dict, keep: str) -> None:
    """Drop the timed models, their optimizers and applied plans, but `keep`'s, and hand
    their memory back to the device."""
    for variant, v in made.items():
        if variant != keep:
            for part in ("setup", "model", "opt", "applied"):
                v.pop(part, None)
    free_device_memory()


def eager_graph_stats(model) -> dict | None:
    """What the FP8 linears' eager CUDA graphs did over the run (`loka.mods.eager_graphs`):
    calls replayed, captured and run eagerly by reason; graphs held. None: no graphs."""
    from collections import Counter

    from loka.mods import Fp8Linear

    total = {"modules": 0, "graphs": 0, "replays": 0, "captures": 0, "eager": Counter()}
    for module in model.modules():
        graphs = getattr(module, "eager_graphs", None) if isinstance(module, Fp8Linear) else None
        if graphs is None or not (graphs.stats.replays or graphs.stats.eager_calls):
            continue
        total["modules"] += 1
        total["graphs"] += len(graphs)
        total["replays"] += graphs.stats.replays
        total["captures"] += graphs.stats.captures
        total["eager"] += graphs.stats.eager
    if not total["modules"]:
        return None
    return total | {"eager": dict(total["eager"])}


def free_device_memory() -> None:
    """Collect what no longer has a reference and hand its GPU memory back to the device."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# A static step builds one graph; jagged batches a second, dynamic in M. More is a graph
# break or a recompile (Wukong xl's bmm mixing once built 11 and ran 22% slower).
MAX_EXPECTED_GRAPHS = 2

QUALITY_SEEDS = {"bf16": 0, "bf16-seed1": 1, "bf16-seed2": 2}


# The share of the free GPU memory a run's estimate may fill: InterFormer xl's four timed
# variants, estimated at 128 GB of the H200's ~140 GB free, did not fit (0.95 let them).
HOLD_SHARE = 0.85


def check_memory(name: str, preset: str, variants: list[str]) -> None:
    """Refuse, in one line, a run whose variants cannot all be held on the GPU at once (the
    interleaved blocks need every model and optimizer resident; one step's activations at a
    time): `zoo.estimate_step`'s state and FP8 bytes per variant, its activations once,
    within `HOLD_SHARE` of the free memory. InterFormer xl with six variants (estimate
    6 x 25 GB + 27 GB) ran out of an H200, and with four (128 GB) too, where three (103 GB)
    ran; HSTU xl's estimate matched its measured peak (80 vs 79 GB)."""
    import torch

    import loka.zoo as zoo

    est = zoo.estimate_step(name, preset)
    free_device_memory()  # what earlier models of this run left must not count as held
    need = len(variants) * (est.state_bytes + est.fp8_bytes)
    need += est.activation_bytes + est.transient_bytes
    free, _ = torch.cuda.mem_get_info()
    if need > HOLD_SHARE * free:
        per = (est.state_bytes + est.fp8_bytes) / 1e9
        usable = HOLD_SHARE * free - est.activation_bytes - est.transient_bytes
        fit = max(0, int(usable / 1e9 / per))
        raise MemoryError(
            f"{name} {preset}: {len(variants)} variants need about {need / 1e9:.0f} GB held at "
            f"once ({per:.0f} GB each, estimated), {free / 1e9:.0f} GB free: run at most {fit} "
            "per call (--variants)"
        )


def predicted_from_step(plan, demoted, bf16_step_ms: float) -> float | None:
    """The plan's speedup predicted from this run's bf16 step: step / (step - the kernel time
    its FP8 sites, less the demoted, save), as verification predicts it."""
    from loka.dispatch.verify import site_gains

    saving = sum(
        ms for unit, ms in site_gains(plan.table, per_pass=True).items()
        if unit not in demoted and unit.rpartition("/")[0] not in demoted
    )  # fmt: skip
    return bf16_step_ms / (bf16_step_ms - saving) if saving < bf16_step_ms else None


def step_ceilings(summary, bf16_step_ms: float) -> dict:
    """The Amdahl ceilings as this run's bf16 step runs the plan's sites (a copy of its
    summary with that step measured): `g_step`, `ceiling_step`, `safe_ceiling_step`."""
    s = dataclasses.replace(summary, measured_bf16_step_ms=bf16_step_ms)
    return {"g_step": s.gemm_share_from_step, "ceiling_step": s.ceiling_from_step,
            "safe_ceiling_step": s.safe_ceiling_from_step}  # fmt: skip


def plan_record(plan) -> dict:
    """A plan as the run's JSON keeps it: summary, FP8 sites and table rows, each row's
    rejected candidates grouped by reason (`{reason: ["backend recipe", ...]}`): listed one
    by one they were 80% of a run's JSON (a DHEN xl eager plan 390 KB), and the results
    travel with every GPU call, whose carry is limited to 64 MiB."""
    rows = plan.table.to_dicts()
    for row in rows:
        grouped: dict[str, list[str]] = {}
        for r in row.get("rejected") or []:
            grouped.setdefault(r["reason"], []).append(f"{r['backend']} {r['recipe']}")
        row["rejected"] = grouped
    return {"summary": plan.summary.__dict__, "fp8_sites": plan.fp8_sites(), "table": rows}


def serving_gemm_share(plan, forward_ms: float) -> float | None:
    """The share of the bf16 serving forward that the linears' GEMMs take, by the bench's
    bf16 kernel times of every site's forward pass (the inference plan's rows, FP8 or not)
    over the measured bf16 forward: the g of the serving aim (>= 1.3x where g >= 0.4)."""
    table = plan.table
    if table.is_empty() or forward_ms <= 0:
        return None
    gemm_ms = sum(r["bf16_ms"] for r in table.iter_rows(named=True) if r["pass"] == "fwd")
    return gemm_ms / forward_ms


def split_variant(variant: str) -> tuple[str, dict]:
    """``NAME@key=value@...``: the variant's name and its own model options, on top of
    `--model-options` (``bf16@attention=math`` is bf16 seed 0's model with InterFormer's
    plain-ops attention, timed beside ``bf16`` in the same process). ``@`` separates them,
    since ``,`` separates the variants."""
    name, *options = variant.split("@")
    out: dict = {}
    for option in options:
        out |= key_values(option, f"variant {variant!r}")
    return name, out


def variant_seed(base: str, extra: dict) -> int:
    """The init (and batch) seed of a variant: a bf16 seed's own, else ``@seed=N`` (taken out
    of `extra`, which holds model options), else 0. ``loka@seed=1`` trains LoKA's plan from
    bf16 seed 1's init, so the quality of a plan is compared seed by seed, not on one draw."""
    seed = extra.pop("seed", None)
    if seed is None:
        return QUALITY_SEEDS.get(base, 0)
    if base in QUALITY_SEEDS and seed != QUALITY_SEEDS[base]:
        raise ValueError(f"variant {base}@seed={seed}: {base} is seed {QUALITY_SEEDS[base]}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"variant {base}@seed={seed!r}: the seed must be an integer >= 0")
    return seed


def is_band_seed(variant: str) -> bool:
    """One of the bf16 seeds whose spread is the noise band (not a bf16 variant with model
    options of its own)."""
    return variant in QUALITY_SEEDS


def model_options(text: str) -> dict:
    """`--model-options`: ``key=value,...`` (values as Python literals, else strings)."""
    return key_values(text, "--model-options")


def key_values(text: str, flag: str) -> dict:
    """`flag`'s ``key=value,...`` (values as Python literals, else strings)."""
    import ast

    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{flag}: {item!r} is not key=value")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def loka_options(variant: str) -> dict:
    """`PlanConfig` fields of a LoKA variant: ``loka`` is the default plan; options follow
    ``+``: ``fast`` (allow fast accumulation, `torch.native.fast` timed too), ``nohost``
    (eager: `charge_host=False`, plan on device time alone), ``min=X``
    (`min_speedup`), ``wq=F`` (`wgrad_quant_factor`: a wgrad's quantization charged at F
    times its standalone time; ``wq=1`` plans on the standalone timing), ``x=GLOB``
    (`exclude`: a site glob, or ``site-glob/pass``; repeatable),
    ``force=GLOB`` (`PlanConfig.force`: FP8 where safe, faster than bf16 or not; repeatable),
    ``bias=gemm`` (`ApplyConfig.bias_grad`: the FP8 sites' bias gradient as a GEMM),
    ``nographs`` (`ApplyConfig.eager_graphs=False`: eager quantization op by op, no CUDA
    graphs; an A/B of `loka.mods.eager_graphs` in the step),
    ``static=MARGIN`` (serving only: `loka.mods.calibrate_input_scales` on training
    batches other than the served ones, static input scales at their amax times MARGIN),
    ``noproducer`` (`fuse_into_producer=False`: x's quantization costed standalone, not
    fused into the op computing x; an A/B of that costing on the real step),
    ``mk`` (this variant compiled with `compile_options(multi_kernel=True)`, the others as
    ``--inductor`` says: multi-kernel against none in one process),
    e.g. ``loka+fast+min=1.15``, ``loka+min=1.05+x=*.mlp.1/wgrad``: several LoKA variants
    side by side, to see which passes pay inside the real step."""
    head, *opts = variant.split("+")
    if head != "loka":
        raise ValueError(f"not a LoKA variant: {variant!r}")
    out: dict = {}
    for opt in opts:
        if opt == "fast":
            out["allow_fast_accum"] = True
        elif opt == "nohost":
            out["charge_host"] = False
        elif opt.startswith("min="):
            out["min_speedup"] = float(opt[4:])
        elif opt.startswith("wq="):
            out["wgrad_quant_factor"] = float(opt[3:])
        elif opt.startswith("x="):
            out["exclude"] = (*out.get("exclude", ()), opt[2:])
        elif opt.startswith("force="):
            out["force"] = (*out.get("force", ()), opt[6:])
        elif opt.startswith("bias="):
            from loka.mods.bias_grad import BIAS_GRADS

            if opt[5:] not in BIAS_GRADS:
                raise ValueError(f"{variant!r}: bias= takes one of {', '.join(BIAS_GRADS)}")
            out["bias_grad"] = opt[5:]
        elif opt == "mk":
            out["multi_kernel"] = True
        elif opt == "noproducer":
            out["fuse_into_producer"] = False
        elif opt == "nographs":
            out["eager_graphs"] = False
        elif opt.startswith("static="):
            try:
                out["static_input_margin"] = float(opt[7:])
            except ValueError:
                raise ValueError(f"{variant!r}: static= takes a margin (a number >= 1)") from None
        else:
            raise ValueError(
                f"{variant!r}: unknown LoKA option {opt!r} (fast, nohost, min=X, wq=F, x=GLOB, "
                "force=GLOB, bias=sum|gemm, nographs, static=MARGIN, mk)"
            )
    return out


# LoKA variant options that are `ApplyConfig` fields (how the plan runs), not `PlanConfig`.
APPLY_OPTIONS = ("bias_grad", "eager_graphs")


# Options of serving variants only, applied after `apply` (`static=`).
SERVING_OPTIONS = ("static_input_margin",)

# Options of how a variant is compiled (`mk`), in neither config.
COMPILE_OPTIONS = ("multi_kernel",)


def split_options(opts: dict) -> tuple[dict, dict]:
    """(`PlanConfig` fields, `ApplyConfig` fields) of a variant's options; serving-only
    options (`SERVING_OPTIONS`) are in neither."""
    plan = {k: v for k, v in opts.items()
            if k not in APPLY_OPTIONS + SERVING_OPTIONS + COMPILE_OPTIONS}  # fmt: skip
    return plan, {k: v for k, v in opts.items() if k in APPLY_OPTIONS}


GRAD_MIN_COSINE = 0.9


def warmup_steps(asked: int, batches: int, cudagraphs: bool) -> int:
    """Untimed steps per variant. Under CUDA graphs each input shape (the jagged batches'
    token counts differ) is warmed up on its first call, recorded on its second and replayed
    from its third: warming up 6 steps over HSTU large's 4 batches left two shapes to be
    recorded in bf16's first timed block (37.2 ms against 23.2)."""
    return max(asked, 3 * batches) if cudagraphs else asked


def failed(row: dict, exc: BaseException) -> None:
    """`error` (one line, the exception) and `traceback` on a variant's row."""
    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row["traceback"] = traceback.format_exc()[-3000:]


def gradient_check(made: dict, batch, autocast, cudagraphs: bool) -> None:
    """One forward and backward of each seed-0 variant on the same batch, before any
    optimizer step, so all start from bf16 seed 0's weights: per parameter (by name), the
    cosine of its gradient with bf16's. A plan that changes what is trained (a zero or
    missing gradient: compiled LoKA plans did, until the `mods.dtypes.cast` fix) is not a
    speedup; FP8 rounding keeps cosines near 1. Writes `grad_min_cosine`, `grad_worst`
    and `grad_ok` (min cosine >= GRAD_MIN_COSINE) into each row."""
    import torch

    def grads(v) -> dict:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        model = v["setup"].model
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = v["setup"].loss(v["model"], batch)
        model.zero_grad(set_to_none=True)
        loss.backward()
        out = {  # sparse table gradients (the xl presets' tables) are left out
            n: (p.grad.detach().float().flatten().clone() if p.grad is not None else None)
            for n, p in model.named_parameters()
            if p.grad is None or p.grad.layout == torch.strided
        }
        model.zero_grad(set_to_none=True)
        return out

    live = {k: v for k, v in made.items()
            if not {"skipped", "error"} & v["row"].keys() and v["row"]["seed"] == 0}  # fmt: skip
    if "bf16" not in live:
        return
    t0 = time.monotonic()
    reference = grads(live["bf16"])
    live["bf16"]["row"]["grad_check_s"] = time.monotonic() - t0  # its first compile, mostly
    for name, v in live.items():
        if name == "bf16":
            continue
        t0 = time.monotonic()
        try:
            got = grads(v)
        except Exception as exc:
            # A variant that does not compile (torchao's tensorwise recipe on HSTU's jagged
            # token count, not a multiple of 16) is its own error row: the mode's bf16 seeds
            # and LoKA plans are still timed.
            failed(v["row"], exc)
            log(f"gradient check {name}: failed, {v['row']['error'][:200]}")
            continue
        v["row"]["grad_check_s"] = time.monotonic() - t0
        worst, worst_name = 1.0, None
        for pname, want in reference.items():
            if want is None or pname not in got or float(want.norm()) == 0.0:
                continue
            have = got[pname]
            cos = (
                0.0
                if have is None or float(have.norm()) == 0.0
                else float(torch.dot(want, have) / (want.norm() * have.norm()))
            )
            if cos < worst:
                worst, worst_name = cos, pname
        v["row"] |= {"grad_min_cosine": worst, "grad_worst": worst_name,
                     "grad_ok": worst >= GRAD_MIN_COSINE}  # fmt: skip
        log(f"gradient check {name}: min cosine with bf16 {worst:.4f} ({worst_name})")


def compile_kwargs(mode: str, dynamic: str, variant: str = "") -> dict:
    """torch.compile's arguments for a compiled `mode`, a `--dynamic` setting and a
    variant's compile options (a LoKA variant's ``mk``)."""
    torch_mode = "reduce-overhead" if mode == "cudagraphs" else "default"
    if variant.startswith(("loka", "infer-loka")) and "multi_kernel" in loka_options(
        split_variant(variant.removeprefix("infer-"))[0]
    ):
        from loka.dispatch.compile_options import compile_options

        kw: dict = {"options": compile_options(torch_mode, multi_kernel=True)}
    else:
        kw = {"mode": torch_mode} if torch_mode != "default" else {}
    if dynamic == "static":
        kw["dynamic"] = False
    elif dynamic != "auto":
        raise ValueError(f"--dynamic: {dynamic!r} is neither auto nor static")
    return kw


def train_and_evaluate(
    args, name, mode, variant, plan, demoted, dynamic, apply_config=None
) -> dict[str, float]:
    """A fresh model of `variant` trained `args.quality_steps` steps in `mode` on fresh
    batches, then its eval metrics (`plan` applied with `apply_config`)."""
    import torch

    import loka.zoo as zoo
    from loka.dispatch import apply

    gpu = args.device == "cuda"
    autocast = torch.bfloat16 if gpu else None
    base, extra = split_variant(variant)
    setup = zoo.create(name, args.preset, device=args.device, seed=variant_seed(base, extra),
                       **(args.model_options | extra))  # fmt: skip
    if plan is not None:
        applied = apply(setup.model, plan, apply_config)
        for site, reason in demoted.items():
            applied.demote(site, reason)
    model = setup.model
    if mode != "eager":
        model = torch.compile(setup.model, **compile_kwargs(mode, dynamic, variant))
    opt = zoo.make_optimizer(setup.model, zoo.OptimizerConfig(lr=1e-3, fused=gpu))
    losses = []
    for _, batch in zip(range(args.quality_steps), setup.train_batches(), strict=False):
        if mode == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        loss = zoo.training_step(setup, model, opt, batch, autocast_dtype=autocast,
                                 check_finite=False)  # fmt: skip
        losses.append(loss.float().clone())  # read once at the end: no sync per step
    return evaluate(setup, autocast) | loss_curve(torch.stack(losses).tolist() if losses else [])


def loss_curve(losses: list[float], points: int = 30) -> dict:
    """The training loss of a quality run, to tell a divergence from a slow drift when a
    variant ends outside the bf16 band: the mean loss over `points` equal windows of steps
    (`loss_curve`), and the largest rise of one step's loss over the mean of the 10 before
    it (`loss_max_rise`, a spike) with its step."""
    if not losses:
        return {}
    n = len(losses)
    edges = [round(i * n / points) for i in range(points + 1)]
    curve = [sum(losses[a:b]) / (b - a) for a, b in itertools.pairwise(edges) if b > a]
    rise, at = 0.0, None
    for i in range(10, n):
        before = sum(losses[i - 10 : i]) / 10
        if losses[i] - before > rise:
            rise, at = losses[i] - before, i
    return {"loss_curve": curve, "loss_max_rise": rise, "loss_max_rise_step": at,
            "loss_last": sum(losses[-10:]) / len(losses[-10:])}  # fmt: skip


def evaluate(setup, autocast) -> dict[str, float]:
    import torch

    model = setup.model
    model.eval()
    device = next(model.parameters()).device.type
    with torch.no_grad(), torch.autocast(device, dtype=autocast or torch.float32,
                                         enabled=autocast is not None):  # fmt: skip
        metrics = setup.metrics(model, setup.eval_batches())
    model.train()
    return {k: float(v) for k, v in metrics.items()}


def served_error(models: dict, batch, extra: dict, autocasting) -> None:
    """How far each FP8 variant's served output is from bf16's on the served batch (the
    plan as served: what verification demoted is bf16 again), with what tells a real 0 from
    a broken check: how much the output varies over the batch (a collapsed model serves one
    value) and how many FP8 linears the forward ran. `models`: the eager modules (a compiled
    one's own module: the same weights and sites)."""
    import torch
    from harness import rel_err

    if len(models) < 2:
        return
    with torch.no_grad(), autocasting():
        want = models["infer-bf16"](batch)
        for variant, model in models.items():
            if variant != "infer-bf16" and isinstance(want, torch.Tensor):
                with counting_fp8_calls(model) as calls:
                    got = model(batch)
                extra[variant] |= {"output_rel_err": rel_err(got, want),
                                   "output_spread": output_spread(want)}  # fmt: skip
                if note := uninformative_output(want):
                    extra[variant]["output_rel_err_note"] = note
                if variant.startswith("infer-loka"):  # torchao's FP8 is not our modules'
                    extra[variant]["fp8_calls"] = calls["fp8"]


@contextlib.contextmanager
def counting_fp8_calls(model):
    """Counts the forwards of `model`'s `Fp8Linear` modules (prequantized or not) while open:
    ``{"fp8": n}``."""
    from loka.mods import Fp8Linear

    calls = {"fp8": 0}

    def count(*_):
        calls["fp8"] += 1

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, Fp8Linear)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def output_spread(out) -> float:
    """The served output's standard deviation over its mean magnitude (0: every example got
    the same value, so no error can show)."""
    out = out.double()
    return float(out.std() / out.abs().mean().clamp_min(1e-300)) if out.numel() > 1 else 0.0


def uninformative_output(out) -> str | None:
    """Why the served error cannot show anything, or None. An under-trained CTR model serves
    nearly the base rate to every example; when the values vary by less than one step of
    the output dtype around their mean, they round to a handful of values and an FP8
    error smaller than that step rounds away with them (InterFormer large, compiled: every
    served value equal, error exactly 0; `realized_20261205T023328Z`)."""
    import torch

    if out.numel() < 2 or not out.is_floating_point():
        return None
    if output_spread(out) < torch.finfo(out.dtype).eps:  # std over mean below one step
        return (
            f"the served output varies by less than one {str(out.dtype).removeprefix('torch.')} "
            "step over the batch: an error below that step cannot show"
        )
    return None


def serving_sizes(text: str | None) -> list[int | None]:
    """`--infer-batch` as a list of batch sizes (None: the training batch)."""
    if not text:
        return [None]
    sizes = [int(v) for v in text.split(",")]
    if any(v <= 0 for v in sizes):
        raise ValueError(f"--infer-batch: sizes must be positive, got {text!r}")
    return sizes


def batch_rows(batch: dict) -> int:
    """Examples in a batch: a jagged one's sequences (`offsets` has one more entry), else
    a CTR batch's leading dimension."""
    if "offsets" in batch:
        return batch["offsets"].numel() - 1
    return next(iter(batch.values())).shape[0]


def stack_jagged(chosen: list[dict]) -> dict:
    """Jagged batches (HSTU's: per-token tensors as long as `offsets[-1]`, `offsets` of the
    sequences, the rest shared by the batch, like its negatives) as one: per-token tensors
    concatenated, offsets shifted, shared tensors from the first batch."""
    import torch

    first = chosen[0]
    out, shift, offsets = {}, 0, [first["offsets"][:1]]
    for b in chosen:
        offsets.append(b["offsets"][1:] + shift)
        shift += int(b["offsets"][-1])
    out["offsets"] = torch.cat(offsets)
    for k, v in first.items():
        if k == "offsets":
            continue
        per_token = (
            isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == int(first["offsets"][-1])
        )
        out[k] = torch.cat([b[k] for b in chosen]) if per_token else v
    return out


def serving_pool(batches: list[dict], size: int | None, stream) -> list[dict]:
    """The training batches a serving batch of `size` examples stacks: the `batches` held,
    or, where it needs more of them (HSTU's 2560 sequences are 10 batches of 256), that
    many drawn from a fresh `stream()` of training batches."""
    if size is None:
        return batches
    need = -(-size // batch_rows(batches[0]))
    if need <= len(batches):
        return batches
    return [b for b, _ in zip(stream(), range(need), strict=False)]


def calibration_batches(setup, served_rows: int, count: int = 4) -> list[dict]:
    """`count` training batches after those that a served batch of `served_rows` examples
    stacks (a fresh stream yields the same batches in the same order), so that static
    scales are calibrated on data the timed and checked forward never sees."""
    stream = setup.train_batches()
    first = next(stream)
    for _ in range(-(-served_rows // batch_rows(first)) - 1):
        next(stream)
    return [next(stream) for _ in range(count)]


def serving_batch(batches: list[dict], size: int | None) -> dict:
    """A batch of `size` examples for serving: the training batches stacked (a multiple of
    the training batch; each tensor's first dimension is the example, or jagged batches
    joined by `stack_jagged`), or the first one."""
    import torch

    first = batches[0]
    if size is None:
        return first
    jagged = "offsets" in first
    tensors = all(isinstance(v, torch.Tensor) and v.dim() for v in first.values())
    rows = batch_rows(first) if tensors else None
    if not tensors or (not jagged and any(v.shape[0] != rows for v in first.values())):
        raise ValueError(
            "serving at another batch size needs a batch of per-example tensors (or a "
            "jagged one with offsets)"
        )
    if size % rows or size // rows > len(batches):
        raise ValueError(
            f"--infer-batch {size}: a multiple of the training batch ({rows}) up to "
            f"{rows * len(batches)} (--batches {len(batches)})"
        )
    chosen = batches[: size // rows]
    if jagged:
        return stack_jagged(chosen)
    return {k: torch.cat([b[k] for b in chosen]) for k in first}


def inference_rows(
    args,
    name,
    mode,
    setup,
    tables,
    bench,
    batch,
    clock,
    left,
    dynamic,
    at_plan_shapes: float = 0.0,
    plans=None,
) -> list[dict]:
    """Forward-only serving of the bf16 seed-0 weights, in `mode`, interleaved blocks.
    `at_plan_shapes`: the served batch in training batches (1.0: the batch the kernels were
    timed at; 0: unknown), so infer-loka gets `predicted_from_step` (bf16's forward less the
    forward kernel time the plan saves), `g` and `ceiling_step` (Amdahl with the plan's
    prequantized GEMM speedup); at another batch they are estimates, the kernel times scaled
    by the batch ratio (`serving_estimated`: GEMMs this large run in time linear in M); the
    inference plan goes into `plans`."""
    import copy

    import torch

    from loka.dispatch import PlanConfig, apply, make_plan
    from loka.dispatch.apply_plan import ApplyConfig

    gpu = args.device == "cuda"
    served = copy.deepcopy(setup.model).eval()
    if gpu:
        served = served.to(torch.bfloat16)
    models = {"infer-bf16": served}
    extra: dict[str, dict] = {"infer-bf16": {}}
    if gpu and "torchao" in args.infer_variants:
        try:
            from torchao.quantization import (
                Float8DynamicActivationFloat8WeightConfig,
                PerRow,
                quantize_,
            )

            quantized = copy.deepcopy(served)
            quantize_(quantized, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            models["infer-torchao-rowwise"], extra["infer-torchao-rowwise"] = quantized, {}
        except Exception as exc:  # torchao absent or refusing these shapes: said in the row
            extra["infer-torchao-rowwise"] = {"error": repr(exc)[:500]}
    loka_variants = [v for v in args.infer_variants if v.split("+")[0] == "loka"]
    switched_off = "loka-off" in args.infer_variants
    applieds: dict = {}
    if loka_variants or switched_off:
        plan = make_plan(tables["sites"], tables["site_errors"], bench.table,
                         PlanConfig(inference=True, mode=mode))  # fmt: skip
        s = plan.summary
        if plans is not None:
            plans[f"{name}/{mode}/{dynamic}/infer@{batch_rows(batch)}"] = plan_record(plan)
    autocast = torch.bfloat16 if gpu else None

    def autocasting():
        return torch.autocast(args.device, dtype=autocast or torch.float32,
                              enabled=autocast is not None)  # fmt: skip

    for variant in loka_variants:
        loka_model = copy.deepcopy(served)
        opts = loka_options(variant)
        _, apply_opts = split_options(opts)
        # An inference plan: weights prequantized for serving.
        applied = apply(loka_model, plan, ApplyConfig(**apply_opts))
        models[f"infer-{variant}"] = loka_model
        applieds[f"infer-{variant}"] = applied
        extra[f"infer-{variant}"] = {"fp8_layers": len(applied.sites), "predicted_gemm_speedup": s.gemm_speedup,
                                     "passes_fp8": s.passes_fp8, "prequantized": len(applied.prequantized)}  # fmt: skip
        if "static_input_margin" in opts and applied.prequantized:
            from loka.mods.static_scales import calibrate_input_scales

            with autocasting():
                amax = calibrate_input_scales(loka_model, calibration_batches(setup, batch_rows(batch)),
                                              margin=opts["static_input_margin"])  # fmt: skip
            extra[f"infer-{variant}"]["static_scales"] = len(amax)
    if switched_off:
        off_model = copy.deepcopy(served)
        off = apply(off_model, plan, ApplyConfig())
        off.use(set())  # every site its original module again, the weights' FP8 copies held
        models["infer-loka-off"] = off_model
        extra["infer-loka-off"] = {"fp8_layers": 0, "switched_off": len(off.sites)}
    eager_models = dict(models)
    if mode != "eager":
        torch._inductor.config.freezing = args.infer_freezing == "on"
        models = {
            k: torch.compile(m, **compile_kwargs(mode, dynamic, k)) for k, m in models.items()
        }

    def forward(model):
        def run(i):
            if mode == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), autocasting():
                model(batch)

        return run

    fns, rows = {}, []
    for variant, model in models.items():
        t0 = time.monotonic()
        try:
            for i in range(3):
                forward(model)(i)
            clock.sync()
            fns[variant] = forward(model)
            extra[variant] = {**extra.get(variant, {}), "compile_s": time.monotonic() - t0}
            log(f"{name}/{mode}/{variant}: compiled and warm in {time.monotonic() - t0:.0f} s")
        except Exception as exc:
            extra[variant] = {
                **extra.get(variant, {}),
                "error": f"{type(exc).__name__}: {exc}"[:2000],
            }
    log(f"{name}/{mode}: inference compiled and warm")
    if args.verify:  # serving's own closed loop: the served forward, as it is timed below
        for variant, applied in applieds.items():
            if variant in fns and "error" not in extra[variant]:
                extra[variant] |= verify_loka(fns[variant], applied, "site", mode)
                log(f"{name}/{mode}/{variant}: verified in {extra[variant]['verify_s']:.0f} s, "
                    f"{extra[variant]['fp8_layers']} sites kept, "
                    f"{len(extra[variant]['demoted'])} demoted")  # fmt: skip
    served_error(eager_models, batch, extra, autocasting)
    try:
        times = interleaved(fns, args.blocks, 2 * args.block_steps, clock, left)
        if args.profile:  # where the serving forward's time goes, kernel by kernel
            for variant, fn in fns.items():
                try:
                    extra[variant]["profile"] = profile(
                        fn, lambda f, i: f(i), out=args.profile_dir,
                        tag=f"{name}_{mode}_{variant}@{batch_rows(batch)}",
                    )  # fmt: skip
                except Exception as e:  # recorded in the row; the timed blocks stay
                    extra[variant]["profile_error"] = f"{type(e).__name__}: {e}"
    finally:
        torch._inductor.config.freezing = False
    base = times.get("infer-bf16")
    for variant in extra:
        row = {"model": name, "mode": mode, "variant": variant, **extra[variant]}
        if variant in times and times[variant] and base:
            row |= {"fwd_ms": statistics.median(times[variant]), "blocks_ms": times[variant],
                    **block_stats(base, times[variant])}  # fmt: skip
            if variant.startswith("infer-loka") and at_plan_shapes:
                # The served forward in the kernels' units: one training batch's worth.
                served_ms = statistics.median(base) / at_plan_shapes
                row["predicted_from_step"] = predicted_from_step(
                    plan, row.get("demoted", {}), served_ms
                )
                row["g"] = serving_gemm_share(plan, served_ms)
                if row["g"] is not None and plan.summary.prequant_speedup:
                    row["ceiling_step"] = amdahl(min(row["g"], 1.0), plan.summary.prequant_speedup)
                if at_plan_shapes != 1.0:
                    row["serving_estimated"] = True
            in_place = extra["infer-bf16"].get("profile", {}).get("gemm_share")
            if variant.startswith("infer-loka") and in_place:
                row["g_in_place"] = in_place
                row["predicted_in_place"] = amdahl(in_place, row["predicted_gemm_speedup"])
        rows.append(row)
    return rows


def amdahl(g: float, s: float) -> float:
    """The whole's speedup when a share `g` of its time runs `s` times faster."""
    return 1.0 / ((1.0 - g) + g / s)


def verify_loka(step, applied, unit: str = "site", mode: str | None = None) -> dict:
    """Dispatch's closed loop (`loka.dispatch.verify`) on LoKA's model and its own step
    (`step(i)`: the i-th training step, or served forward)."""
    from loka.dispatch.verify import VerifyConfig, verify

    counter = iter(range(10**9))
    t0 = time.monotonic()
    config = VerifyConfig(steps_per_block=8, blocks=3, drop=2, max_rounds=3, unit=unit)
    result = verify(lambda: step(next(counter)), applied, config, mode=mode)
    return {
        "verify_s": time.monotonic() - t0,
        "verified_speedup": result.speedup, "verified_interval": [result.low, result.high],
        "verify_steps": result.steps, "demoted": dict(result.demoted),
        "fp8_layers": len(result.kept), "verify_lines": result.lines(),
        "verify_rounds": [r.as_dict() for r in result.rounds],
    }  # fmt: skip


def saved_for_backward(v, step_fn) -> dict:
    """What one step keeps for its backward (through `saved_tensors_hooks`, which see the
    compiled graph's saved activations too): MB and count per dtype. An FP8 pass changes
    what the compiled graph saves and what its backward recomputes (on the CPU: with any
    pass of a linear in FP8, the partitioner recomputed the bf16 input and weight in the
    backward instead of saving them), a cost no kernel timing sees. The hooks may cost
    one recompile."""
    import torch

    saved: dict[str, list[float]] = {}

    def pack(t):
        entry = saved.setdefault(str(t.dtype).removeprefix("torch."), [0.0, 0])
        entry[0] += t.numel() * t.element_size() / 2**20
        entry[1] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step_fn(v, 0)
    return {k: {"mb": round(mb, 1), "count": n} for k, (mb, n) in sorted(saved.items())}


# The aten ops a linear's GEMMs run as (bf16 and FP8; not the models' own bmm).
LINEAR_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::_scaled_mm"})


def prediction_parts(plan, kernel_bench, folder, base_table: str, table: str) -> dict:
    """A plan's FP8 passes as the bench timed them (bf16 GEMMs, FP8 GEMMs, quantization)
    beside what the step spent on them by its profile against bf16's
    (`profile_summary.parts_in_step`): which part of the prediction missed."""
    from profile_summary import parts_as_timed, parts_in_step, saving

    try:
        timed = parts_as_timed(plan.table.to_dicts(), kernel_bench)
    except KeyError as e:
        return {"error": str(e.args[0])}
    in_step = parts_in_step(str(Path(folder, base_table)), str(Path(folder, table)), PROFILE_STEPS)
    return {"timed": timed, "in_step": in_step,
            "saving_timed": saving(timed), "saving_in_step": saving(in_step)}  # fmt: skip


def profile(v, step_fn, out, tag) -> dict:
    """torch.profiler over a few steps: CUDA and CPU time per step, top kernels by time."""
    import torch
    from harness import profile_events

    steps = PROFILE_STEPS
    gpu = torch.cuda.is_available()
    events = profile_events(lambda i: step_fn(v, i), steps)
    table = events.table(
        sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=200,
        max_name_column_width=160,
    )  # fmt: skip
    # Variant names hold globs, slashes, "+" and "=" ("loka+x=*.mlp.1/wgrad"): letters,
    # digits, "_", "." and "-" only, the characters the GPU host's files come back with.
    Path(out).mkdir(parents=True, exist_ok=True)
    name = f"profile_{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}.txt"
    Path(out, name).write_text(table)
    cuda_total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    gemm = sum(e.self_device_time_total for e in events if e.key in LINEAR_GEMM_OPS) / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:50]
    return {
        "table": name,
        "gpu_ms_per_step": cuda_total,
        # The linears' GEMMs in place: bf16's share is the g of the Amdahl ceiling as the
        # step runs it (the bench's isolated bf16 GEMMs ran ~20% slower than inside a
        # compiled serving forward: realized_20261202T204815Z).
        "gemm_ms_per_step": gemm,
        "gemm_share": gemm / cuda_total if cuda_total else None,
        "top": [
            (e.key[:160], e.self_device_time_total / 1e3 / steps, e.count // steps) for e in top
        ],
    }


if __name__ == "__main__":
    main()
