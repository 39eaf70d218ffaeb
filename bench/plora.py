"""PLoRA on the GPU: packed concurrent LoRA vs one job after another, kernels vs a loop.

A Llama-style model of ~0.7B parameters with random weights (LlamaConfig, no download),
LoRA on all seven linears of every layer, 32 job configurations (ranks 8-64, per-job batch
sizes 1-4, lr, alpha, 12-20 steps each); everything in one run:
- kernels:  the segmented multi-LoRA op (forward + backward): the base linear and the
            adapters as one op (fused_base, what PackedLoraLinear runs), and the base GEMM
            then the adapters on both kernel paths (fused, 4 launches; unfused: the first
            kernels, 6), against the same computation as a Python loop over adapters and
            the base GEMM alone (forward + input gradient), at the model's linear shapes and
            the 32-job token count; each checked against a float64 reference first. The
            adapters' share of the base GEMM's time (issue 19's aim: <= 25%) three ways: with
            per-adapter leaves as in a step, the op alone (wall clock), the op alone in GPU
            kernel time (profiler).
- steps:    one packed training step (all jobs active) for packs of 1, 2, 4, 8, 16, 32 jobs
            with the Triton kernels; the loop backend for 8 and 32; and one job alone with
            peft (its defaults, fused AdamW) for every (rank, batch size) pair used. These
            records (plora_steps_*.csv) are what `loka lora-plan --throughput` fits.
- baseline: (not in the default sections) sequential peft jobs at their best (issue 19's
            fair baseline): for every (rank, batch size) pair of the 32 jobs, the steady-state
            rate of one peft job eager and torch.compile'd (Inductor; smoke: Dynamo's eager
            backend) at its own batch and at the largest power-of-two micro-batch <=
            --baseline-cap whose eager step peaks within 85% of the device's memory (probed
            with max_memory_allocated); compile time per shape apart. The summary turns the
            rates into sequential makespans (`loka.plora.plan.fair_sequential_makespan`):
            eager at the own batch (the old baseline), best variant at the own batch (the
            job's own optimizer steps), best variant and micro-batch (the same samples in
            fewer, bigger steps: a different optimization), and puts makespan, plan and
            throughput ratios of PLoRA against them.
- makespan: 8 and 32 jobs trained to their step counts: packed (one pack: jobs leave it as
            they finish) against each job alone with peft, one after another, wall clock
            (eager, own batch); with the baseline section, also against its makespans.
- profile:  (not in the default sections) where a step's time goes: torch.profiler over a
            few steps of a packed pack of 1 job and of the largest pack, and of one peft
            job alone (each after warm-up): wall time per step beside GPU kernel time
            (busy), the host time of the packed step's phases (forward, backward, optimizer
            step, loss readback: `loka.plora.runner`'s record_function labels), kernel
            launches per step, and the ops with the most host time and the kernels with the
            most GPU time (tables in plora_profile_*.txt beside the JSON).
- plan:     the schedule `loka lora-plan` makes for the 32 jobs (`plan_lora_jobs`: step
            times fit on this run's packed step profiles, else profiled here; memory
            calibrated on their peaks, against this device's memory; --plan-gpus GPUs;
            --plan-lengths gives the jobs different sequence lengths), then run: each pack
            trained to its jobs' step counts (jobs leaving as they finish; one untimed
            warm-up step first), GPU by GPU in the schedule's order on this one device, so
            a GPU's measured time is the sum of its packs and the measured makespan the
            largest; predicted beside measured, per pack and in all.

    python bench/plora.py --smoke     # CPU, Triton interpreter, tiny model, < 1 min
    python bench/plora.py             # one H200, about 4 min
    python bench/plora.py --sections steps,plan --plan-gpus 2 --plan-lengths 512,256
    python bench/plora.py --sections baseline,makespan,plan --budget-s 540   # fair baseline
Results in --out (default $OUT, else bench/results/): plora_<mode>_<utc>.json (every raw
record, the summary, the metadata), plora_steps_<mode>_<utc>.csv (step profiles),
plora_schedule_<mode>_<utc>.csv (the plan section's schedule, with measured pack times).
The files are written (atomically) as the run goes: after each section and before each unit
of work in one, the JSON with "complete": false, "sections_done" and "section_running" (its
rows so far), so a run that is killed keeps what it finished; "complete": true at the end.
Progress lines ([plora  35 s] ..., flushed) tell where the time went.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from harness import (
    Budget,
    device_kernels,
    metadata,
    parser,
    profile_events,
    rel_err,
    time_ms,
    version,
    write_csv,
    write_json,
)
from harness import stamp as utc_stamp

_T0 = time.monotonic()  # progress lines count from here (imports, model build included)


def log(message: str) -> None:
    """A progress line with the seconds since start, flushed at once (bench/realized.py's):
    a killed run's log still shows where its time went."""
    print(f"[plora {time.monotonic() - _T0:6.0f} s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)  # --out, --budget-s (270 s; smoke 60)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (Triton interpreter)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (512; smoke 16)")
    p.add_argument("--sections", default="kernels,steps,makespan,plan",
                   help="comma-separated, of kernels,steps,baseline,makespan,profile,plan")  # fmt: skip
    p.add_argument("--no-autotune", action="store_true", help="heuristic kernel tiles only")
    p.add_argument("--plan-gpus", type=int, default=1, help="GPUs the plan section plans for")
    p.add_argument("--plan-lengths", default=None,
                   help="comma-separated seq_len cycled over the plan's jobs (default: --seq-len; "
                        "smoke: 8,4)")  # fmt: skip
    p.add_argument("--baseline-cap", type=int, default=None,
                   help="largest micro-batch the baseline section tries (64; smoke 4)")  # fmt: skip
    p.add_argument("--baseline-backend", default=None,
                   help="torch.compile backend of the compiled baseline (inductor; smoke: eager)")  # fmt: skip
    p.add_argument("--baseline-mode", default=None,
                   help="torch.compile mode with inductor (default; e.g. reduce-overhead, max-autotune)")  # fmt: skip
    p.add_argument("--baseline-ranks", default=None,
                   help="comma-separated: the baseline section rates only the jobs of these ranks "
                        "(each compiled rate compiles for a minute or more)")  # fmt: skip
    p.add_argument("--baseline-largest-only", action="store_true",
                   help="baseline: rate only each rank's largest micro-batch (eager and compiled), "
                        "not the compiled own batches")  # fmt: skip
    p.add_argument("--packed", default="eager", choices=("eager", "compiled", "both"),
                   help="how the makespan section runs packed steps: eager, with the forward "
                        "and loss compiled (`loka.plora.runner.compiled_loss`; inductor, smoke: "
                        "aot_eager), or both, one after the other per job count")  # fmt: skip
    p.add_argument(
        "--makespan-jobs",
        default=None,
        help="comma-separated job counts of the makespan section (8,32; smoke 2)",
    )
    p.add_argument(
        "--no-sequential",
        action="store_true",
        help="makespan: skip the sequential eager peft runs (85 s for 32 jobs)",
    )
    return p.parse_args(argv)


import torch  # noqa: E402

if not torch.cuda.is_available():  # only --smoke runs on a CPU: in Triton's interpreter,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before any @triton.jit is created

import torch.nn.functional as F  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from loka.plora import (  # noqa: E402
    LoraJobConfig,
    PackedLoraConfig,
    PerAdapterOptimizer,
    convert_to_packed_lora,
)
from loka.plora.kernels import (  # noqa: E402
    MultiLoraLayout,
    multi_lora_base_linear,
    multi_lora_linear,
    multi_lora_linear_reference,
)
from loka.plora.plan import (  # noqa: E402
    MemoryModel,
    ModelShape,
    ThroughputModel,
    fair_sequential_makespan,
    plan_lora_jobs,
    probe_batch_size,
    profile_throughput,
)
from loka.plora.plan.baseline import POLICIES as BASELINE_POLICIES  # noqa: E402
from loka.plora.runner import compiled_loss, packed_train_step, token_losses  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS, BATCH_SIZES = (8, 16, 32, 64), (1, 2, 3, 4)


def configure(args: argparse.Namespace) -> None:
    """Set the run's globals from its arguments (main() does; importing sets the full run's)."""
    global ARGS, MODE, SEQ, BUDGET, MODEL, JOB_COUNTS, PACK_SIZES, STEPS, TIMED, WARMUP, CAP
    ARGS, MODE = args, "smoke" if args.smoke else "full"
    SEQ = args.seq_len or (8 if args.smoke else 512)
    BUDGET = Budget(args.budget_s or (60.0 if args.smoke else 270.0))
    CAP = args.baseline_cap or (4 if args.smoke else 64)
    if args.smoke:
        MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
        JOB_COUNTS, PACK_SIZES, STEPS = (2,), (1, 2), (1, 2)
        TIMED, WARMUP = 1, 1
    else:
        MODEL = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=12, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
        JOB_COUNTS, PACK_SIZES, STEPS = (8, 32), (1, 2, 4, 8, 16, 32), (12, 16, 20)
        TIMED, WARMUP = 5, 2
    global MAKESPAN_JOBS
    MAKESPAN_JOBS = (tuple(int(n) for n in args.makespan_jobs.split(","))
                     if args.makespan_jobs else JOB_COUNTS)  # fmt: skip


configure(parse_args([]))


def make_jobs(n: int) -> list[LoraJobConfig]:
    # Ranks cycle fastest and batch sizes every 4 jobs, so 16 jobs cover every pair.
    return [
        LoraJobConfig(
            f"job{i:02d}",
            rank=RANKS[i % 4],
            alpha=2.0 * RANKS[i % 4],
            lr=(1e-4, 3e-4, 1e-3)[i % 3],
            batch_size=BATCH_SIZES[(i // 4) % 4],
            steps=STEPS[i % len(STEPS)],
            seed=i,
        )
        for i in range(n)
    ]


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def over_budget() -> bool:
    return BUDGET.over()


def time_fn(fn, reps: int = 20) -> float:
    """Median milliseconds of fn(): triton's do_bench on the GPU, wall clock on CPU."""
    return time_ms(fn, DEVICE, reps=2, rep_ms=reps * 5)


# ---------------------------------------------------------------------------------------
# kernels: the segmented op vs a Python loop over adapters, at the model's linear shapes
# ---------------------------------------------------------------------------------------


def bench_kernels(jobs: list[LoraJobConfig]) -> list[dict]:
    h, i = MODEL["hidden_size"], MODEL["intermediate_size"]
    kv = MODEL["num_key_value_heads"] * (h // MODEL["num_attention_heads"])
    tokens = [j.batch_size * SEQ for j in jobs]
    layout = MultiLoraLayout.from_token_counts(
        tokens, [j.rank for j in jobs], [j.scale for j in jobs], DEVICE
    )
    rows = []
    shapes = {"q/o": (h, h), "k/v": (h, kv), "gate/up": (h, i), "down": (i, h)}
    for name, (k, n) in list(shapes.items())[: 1 if ARGS.smoke else None]:
        if over_budget():
            log(f"kernels: {name} skipped, over the time budget")
            rows.append({"shape": name, "error": "skipped: over the time budget"})
            continue
        log(f"kernels: {name} (K {k}, N {n}) ...")
        begin = time.monotonic()
        try:
            rows.append(_bench_shape(name, k, n, jobs, layout))
        except Exception as err:  # one failing shape is a row, not a crash
            rows.append({"shape": name, "K": k, "N": n, "error": f"{type(err).__name__}: {err}",
                         "trace": traceback.format_exc(limit=3)})  # fmt: skip
        log(f"kernels: {name} {'failed' if 'error' in rows[-1] else 'done'} in "
            f"{time.monotonic() - begin:.1f} s")  # fmt: skip
    return rows


AIM = 0.25  # issue 19: the packed adapter forward + backward <= 25% of the base GEMM's time
# What runs the base linear + adapters: "fused_base" multi_lora_base_linear (one op: the
# adapters write into the base GEMM's output and input gradient; PackedLoraLinear's default),
# "fused" and "unfused": F.linear then multi_lora_linear on that kernel path.
PATHS = ("fused_base", "fused", "unfused")


def device_ms(fn, reps: int = 10) -> tuple[float | None, list]:
    """GPU time of one fn() call: the sum of its kernels' durations (torch.profiler, CUDA
    activity only), so host launch gaps do not count, and the kernels by time (name, ms per
    call, launches per call); (None, []) on CPU or if the profiler fails."""
    if DEVICE.type != "cuda":
        return None, []
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            sync()
        events = sorted(
            device_kernels(prof.key_averages()), key=lambda e: -e.self_device_time_total
        )
        kernels = [(e.key[:80], e.self_device_time_total / reps / 1e3, e.count / reps)
                   for e in events]  # fmt: skip
        return sum(ms for _, ms, _ in kernels), kernels[:12]
    except Exception:  # a profiler failure leaves the wall-clock numbers standing
        return None, []


def _bench_shape(name, k, n, jobs, layout) -> dict:
    """The op at one linear shape. Times (ms), each the base GEMM (forward + input gradient)
    plus the adapters, against the base GEMM alone:
    - t_{path}_ms: per-adapter leaves concatenated by torch.cat (a step before
      PackedLoraLinear's packed leaves; 64 AccumulateGrads backward), wall clock (do_bench,
      host included);
    - t_op_{path}_ms: the op alone on packed leaves a_cat, b_cat (as PackedLoraLinear has
      them, and what issue 19's aim is about), wall clock;
    - device_op_{path}_ms: the same, GPU kernel time only (torch.profiler), and
      device_kernels_{path}: its kernels by time (name, ms per call, launches per call).
    adapter_over_base_* = (t - base) / base; its aim is <= AIM."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    t = layout.num_tokens
    x = torch.randn(t, k, device=DEVICE, generator=gen).to(DTYPE)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(DTYPE)
    dy = torch.randn(t, n, device=DEVICE, generator=gen).to(DTYPE)
    a_list = [
        (torch.randn(j.rank, k, device=DEVICE, generator=gen) / k**0.5).to(DTYPE) for j in jobs
    ]
    b_list = [
        (torch.randn(n, j.rank, device=DEVICE, generator=gen) / j.rank**0.5).to(DTYPE) for j in jobs
    ]

    def leaves():
        return [v.clone().requires_grad_() for v in (x, *a_list, *b_list)]

    def op(xs, a_cat, b_cat, path):
        if path == "fused_base":
            return multi_lora_base_linear(xs, w, None, a_cat, b_cat, layout, path="fused")
        return multi_lora_linear(xs, xs @ w.t(), a_cat, b_cat, layout, path=path)

    def run_triton(vs, path):
        xs, a_s, b_s = vs[0], vs[1 : len(jobs) + 1], vs[len(jobs) + 1 :]
        y = op(xs, torch.cat(a_s), torch.cat(b_s, dim=1), path)
        y.backward(dy)
        return y

    def run_op(vs, path):  # vs: x, a_cat, b_cat leaves
        y = op(*vs, path)
        y.backward(dy)
        return y

    def run_loop(vs):
        xs, a_s, b_s = vs[0], vs[1 : len(jobs) + 1], vs[len(jobs) + 1 :]
        y = multi_lora_linear_reference(xs, xs @ w.t(), a_s, b_s, layout)
        y.backward(dy)
        return y

    # Correctness first: every path against float64.
    ref_vs = [v.double().requires_grad_() for v in (x, *a_list, *b_list)]
    y_ref = multi_lora_linear_reference(ref_vs[0], ref_vs[0] @ w.double().t(), ref_vs[1 : len(jobs) + 1],
                                        ref_vs[len(jobs) + 1 :], layout)  # fmt: skip
    y_ref.backward(dy.double())
    errors = {}
    runners = {**{p: (lambda vs, p=p: run_triton(vs, p)) for p in PATHS}, "loop": run_loop}
    for label, runner in runners.items():
        vs = leaves()
        y = runner(vs)
        errors[label] = {
            "y": rel_err(y.detach(), y_ref.detach()),
            "dx": rel_err(vs[0].grad, ref_vs[0].grad),
            "dA": max(rel_err(v.grad, r.grad) for v, r in zip(vs[1 : len(jobs) + 1], ref_vs[1 : len(jobs) + 1], strict=True)),
            "dB": max(rel_err(v.grad, r.grad) for v, r in zip(vs[len(jobs) + 1 :], ref_vs[len(jobs) + 1 :], strict=True)),
        }  # fmt: skip
    bound = 2e-2 if DTYPE is torch.bfloat16 else 1e-4
    ok = all(e <= bound for path in errors.values() for e in path.values())

    xg = x.clone().requires_grad_()

    def run_base():
        (xg @ w.t()).backward(dy)

    t_base = time_fn(run_base)
    device_base, _ = device_ms(run_base)
    row = {"shape": name, "K": k, "N": n, "tokens": t, "adapters": len(jobs), "t_base_ms": t_base,
           "device_base_ms": device_base, "aim_adapter_over_base": AIM}  # fmt: skip
    for path in PATHS:
        vs = leaves()
        row[f"t_{path}_ms"] = time_fn(lambda vs=vs, p=path: run_triton(vs, p))
        cat = [x.clone().requires_grad_(), torch.cat(a_list).requires_grad_(),
               torch.cat(b_list, dim=1).requires_grad_()]  # fmt: skip
        row[f"t_op_{path}_ms"] = time_fn(lambda vs=cat, p=path: run_op(vs, p))
        device, kernels = device_ms(lambda vs=cat, p=path: run_op(vs, p))
        row[f"device_op_{path}_ms"], row[f"device_kernels_{path}"] = device, kernels
        row[f"adapter_over_base_{path}"] = (row[f"t_{path}_ms"] - t_base) / t_base
        row[f"adapter_over_base_op_{path}"] = (row[f"t_op_{path}_ms"] - t_base) / t_base
        if device_base and row[f"device_op_{path}_ms"] is not None:
            row[f"adapter_over_base_device_{path}"] = (
                row[f"device_op_{path}_ms"] - device_base
            ) / device_base
    vs_l = leaves()
    t_loop = time_fn(lambda: run_loop(vs_l))
    t_triton = row["t_fused_base_ms"]  # what PackedLoraLinear runs, under the first key
    return {
        **row, "t_triton_ms": t_triton, "t_loop_ms": t_loop,
        "loop_over_triton": t_loop / t_triton,
        "fused_over_unfused": row["t_op_unfused_ms"] / row["t_op_fused_ms"],
        "fused_base_over_unfused": row["t_op_unfused_ms"] / row["t_op_fused_base_ms"],
        "lora_overhead_triton": (t_triton - t_base) / t_base,
        "lora_overhead_loop": (t_loop - t_base) / t_base,
        "rel_err": errors, "err_bound": bound, "ok": ok,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------
# steps: packed steps of growing packs, the loop backend, and single jobs with peft
# ---------------------------------------------------------------------------------------


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL, max_position_embeddings=max(2048, SEQ))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(DTYPE)
    model.config.use_cache = False
    return model


def token_batches(jobs, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    return [
        (i, torch.randint(0, vocab, (j.batch_size, SEQ + 1), generator=gen))
        for i, j in enumerate(jobs)
    ]


def packed_step_profile(model, jobs, backend: str) -> dict:
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend=backend))
    try:
        opt = PerAdapterOptimizer(packed)
        batches = token_batches(jobs)
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(WARMUP):
            packed_train_step(packed, opt, batches)
        sync()
        begin = time.perf_counter()
        for _ in range(TIMED):
            packed_train_step(packed, opt, batches)
        sync()
        step = (time.perf_counter() - begin) / TIMED
        peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0
    finally:
        packed.remove()
    tokens = sum(j.batch_size * SEQ for j in jobs)
    return {
        "kind": "packed", "backend": backend, "n_adapters": len(jobs), "tokens": tokens,
        "rank_tokens": sum(j.rank * j.batch_size * SEQ for j in jobs), "step_time_s": step,
        "tokens_per_s": tokens / step, "peak_memory_bytes": int(peak), "device": str(DEVICE),
    }  # fmt: skip


def peft_wrap(model, job):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=job.rank, lora_alpha=job.alpha, lora_dropout=0.0, target_modules=list(TARGETS)
    )
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    fused = DEVICE.type == "cuda"
    opt = torch.optim.AdamW(params, lr=job.lr, fused=fused, foreach=None if fused else True)
    return peft_model, params, opt


def peft_loss(peft_model, ids):
    logits = peft_model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def peft_step(peft_model, params, opt, job, ids, loss_fn=None) -> float:
    """One training step of one peft job; `loss_fn(ids)` (e.g. a compiled one) replaces
    the eager forward + loss."""
    ids = ids.to(DEVICE, non_blocking=True)
    loss = loss_fn(ids) if loss_fn is not None else peft_loss(peft_model, ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    # A trainer logs its loss: one sync per step, as the packed step has.
    return float(loss.detach())


def peft_step_profile(model, job) -> dict:
    peft_model, params, opt = peft_wrap(model, job)
    try:
        ids = token_batches([job])[0][1]
        for _ in range(WARMUP):
            peft_step(peft_model, params, opt, job, ids)
        sync()
        begin = time.perf_counter()
        for _ in range(TIMED):
            peft_step(peft_model, params, opt, job, ids)
        sync()
        step = (time.perf_counter() - begin) / TIMED
    finally:
        peft_model.unload()
    tokens = job.batch_size * SEQ
    return {
        "kind": "solo_peft", "backend": "peft", "n_adapters": 1, "rank": job.rank,
        "batch_size": job.batch_size, "tokens": tokens, "rank_tokens": job.rank * tokens,
        "step_time_s": step, "tokens_per_s": tokens / step, "device": str(DEVICE),
    }  # fmt: skip


def bench_steps(model, jobs, rows: list | None = None) -> list[dict]:
    """Step profiles, appended to `rows` (main's: a partial write keeps those done)."""
    plans = [("triton", jobs[:n]) for n in PACK_SIZES]
    first = jobs[0]
    doubled = LoraJobConfig(
        first.name + "x2", first.rank, first.alpha, first.lr, 2 * first.batch_size, steps=1
    )
    # Tokens change alone: separates the per-token from the per-step cost.
    plans.append(("triton", [doubled]))
    plans += [("loop", jobs[:n]) for n in JOB_COUNTS]
    rows = [] if rows is None else rows
    for backend, pack in plans:
        label = f"steps: packed {backend}, {len(pack)} job(s), {sum(j.batch_size for j in pack)} samples"
        rows.append(_guarded(lambda b=backend, p=pack: packed_step_profile(model, p, b),
                             {"kind": "packed", "backend": backend, "n_adapters": len(pack)}, label))  # fmt: skip
    pairs = sorted({(j.rank, j.batch_size) for j in jobs})
    for rank, batch in pairs:
        job = next(j for j in jobs if (j.rank, j.batch_size) == (rank, batch))
        rows.append(_guarded(lambda j=job: peft_step_profile(model, j),
                             {"kind": "solo_peft", "rank": rank, "batch_size": batch},
                             f"steps: peft alone r{rank} batch {batch}"))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------
# profile: where a packed step's time goes (host phases, GPU kernels, launches)
# ---------------------------------------------------------------------------------------

PHASES = ("plora.forward", "plora.backward", "plora.optimizer", "plora.readback")
LAUNCHES = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaLaunchKernelExC"})  # fmt: skip
PROFILED_STEPS = 3


def profile_steps(step, tag: str, out: Path, stamp: str) -> dict:
    """`step()` after warm-up: wall time per step (timed apart), then torch.profiler over
    PROFILED_STEPS steps: GPU kernel time, host time per phase, launches, top ops."""
    for _ in range(WARMUP):
        step()
    sync()
    begin = time.perf_counter()
    for _ in range(TIMED):
        step()
    sync()
    wall = (time.perf_counter() - begin) / TIMED
    gpu = DEVICE.type == "cuda"
    events = profile_events(lambda i: step(), PROFILED_STEPS)
    per_step = 1e3 * PROFILED_STEPS  # profiler microseconds -> ms per step

    def top(ordered, attr: str) -> list[tuple[str, float, int]]:
        return [(e.key[:100], getattr(e, attr) / per_step, e.count // PROFILED_STEPS)
                for e in ordered[:20]]  # fmt: skip

    # A record_function label appears twice: its CPU range, and a GPU "user annotation"
    # spanning the kernels it launched, which counting as kernel time would double busy.
    kernels = sorted(device_kernels(events), key=lambda e: -e.self_device_time_total)
    phases = {e.key: e.cpu_time_total / per_step for e in events
              if e.key in PHASES and e.device_type == DeviceType.CPU}  # fmt: skip
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)
    name = f"plora_profile_{MODE}_{stamp}_{tag}.txt"
    Path(out, name).write_text(
        events.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=100)
        + "\n\n" + (events.table(sort_by="self_cuda_time_total", row_limit=40,
                                   max_name_column_width=100) if gpu else "")
    )  # fmt: skip
    return {
        "wall_ms_per_step": wall * 1e3,
        "gpu_busy_ms_per_step": sum(e.self_device_time_total for e in kernels) / per_step,
        "host_ms_per_phase": phases,
        "launches_per_step": sum(e.count for e in events if e.key in LAUNCHES) / PROFILED_STEPS,
        "top_host_ops": top(host, "self_cpu_time_total"),
        "top_kernels": top(kernels, "self_device_time_total"),
        "table": name,
    }


def packing_modes() -> tuple[bool, ...]:
    """Whether each packed run of --packed compiles (eager, compiled, or both in turn)."""
    return {"eager": (False,), "compiled": (True,), "both": (False, True)}[ARGS.packed]


def packed_loss(compiled: bool):
    """The packed step's loss function: eager, or compiled cold (Dynamo reset first; inductor,
    smoke: aot_eager)."""
    if not compiled:
        return token_losses
    torch._dynamo.reset()
    return compiled_loss(backend="aot_eager" if ARGS.smoke else "inductor")


def bench_profile(model, jobs, rows: list, out: Path, stamp: str) -> list[dict]:
    """Packed steps of 1 job and of the largest pack (eager, compiled or both: --packed), and
    one peft job alone, profiled."""
    largest = jobs[: max(JOB_COUNTS)]
    for pack, compiled in ((p, c) for p in (jobs[:1], largest) for c in packing_modes()):
        tag = f"packed{len(pack)}{'_compiled' if compiled else ''}"

        def run(pack=pack, tag=tag, compiled=compiled) -> dict:
            packed = convert_to_packed_lora(model, pack, PackedLoraConfig(backend="triton"))
            loss_fn = packed_loss(compiled)
            try:
                opt = PerAdapterOptimizer(packed)
                batches = token_batches(pack)
                got = profile_steps(
                    lambda: packed_train_step(packed, opt, batches, loss_fn=loss_fn), tag, out,
                    stamp,
                )  # fmt: skip
            finally:
                packed.remove()
            return {"kind": "profile", "what": "packed", "compiled": compiled,
                    "n_adapters": len(pack), "tokens": sum(j.batch_size * SEQ for j in pack),
                    **got}  # fmt: skip

        rows.append(_guarded(run, {"kind": "profile", "what": tag}, f"profile: {tag}"))
    job = jobs[0]

    def run_peft() -> dict:
        peft_model, params, opt = peft_wrap(model, job)
        try:
            ids = token_batches([job])[0][1]
            got = profile_steps(lambda: peft_step(peft_model, params, opt, job, ids), "peft",
                                out, stamp)  # fmt: skip
        finally:
            peft_model.unload()
        return {"kind": "profile", "what": "solo_peft", "n_adapters": 1, "rank": job.rank,
                "tokens": job.batch_size * SEQ, **got}  # fmt: skip

    rows.append(_guarded(run_peft, {"kind": "profile", "what": "solo_peft"}, "profile: peft"))
    return rows


def print_profiles(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            continue
        phases = "  ".join(f"{k.split('.')[1]} {v:.1f}" for k, v in r["host_ms_per_phase"].items())
        what = r["what"] + (" compiled" if r.get("compiled") else "")
        print(f"  profile {what:15s} {r['n_adapters']:2d} job(s) {r['tokens']:6d} tokens: "
              f"wall {r['wall_ms_per_step']:8.1f} ms  GPU busy {r['gpu_busy_ms_per_step']:8.1f} ms  "
              f"launches {r['launches_per_step']:6.0f}  host ms {phases or '-'}")  # fmt: skip


_CHECKPOINT = None  # main() sets it: writes the partial results (the rows so far)
_LAST_UNIT_S = 0.0  # seconds the last unit _guarded ran took (its checkpoint not included)


def checkpoint() -> None:
    """Write the partial results, if main() asked for it; a failure is logged, not raised
    (the run goes on, and its final write says what is wrong)."""
    if _CHECKPOINT is not None:
        try:
            _CHECKPOINT()
        except Exception as err:
            log(f"could not write the partial results: {type(err).__name__}: {err}")


def _guarded(fn, context: dict, label: str | None = None, need_s: float = 0.0) -> dict:
    """fn()'s row, or `context` with its error; skipped when less than `need_s` seconds of
    the budget are left (none: past the budget). The rows so far are written first, and
    progress lines mark the unit's start and end (`label`, default: from `context`)."""
    global _LAST_UNIT_S
    checkpoint()
    _LAST_UNIT_S = 0.0
    label = label or " ".join(f"{k} {v}" for k, v in context.items())
    left = BUDGET.left()
    if BUDGET.over(need_s):
        why = f" (about {need_s:.1f} s needed, {max(left, 0.0):.1f} s left)" if need_s else ""
        log(f"{label}: skipped, over the time budget{why}")
        return {**context, "error": f"skipped: over the time budget{why}"}
    log(f"{label} ...")
    begin = time.monotonic()
    try:
        row = fn()
    except Exception as err:
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        _LAST_UNIT_S = time.monotonic() - begin
        log(f"{label}: {type(err).__name__} after {_LAST_UNIT_S:.1f} s")
        return {
            **context,
            "error": f"{type(err).__name__}: {err}",
            "trace": traceback.format_exc(limit=3),
        }
    _LAST_UNIT_S = time.monotonic() - begin
    log(f"{label}: done in {_LAST_UNIT_S:.1f} s")
    return row


# ---------------------------------------------------------------------------------------
# makespan: train the jobs to their step counts, packed vs one after another
# ---------------------------------------------------------------------------------------


def train_pack(packed, opt, batch, left: list[int], loss_fn=token_losses) -> dict:
    """Train a converted pack until every job's `left` steps are done, jobs leaving as they
    finish; each step timed (a sync after it). A pack of other jobs (another total rank)
    runs kernels the autotuner has not seen, so the first step of each composition carries
    their tuning and compiles: `steady_s` charges it at the median of that composition's
    other steps (else of all others), the rest is `first_use_s`, what a long job pays once
    (the sequential baseline's compile time is likewise kept apart)."""
    step_s, first, comps = [], [], []
    seen = set()
    while any(left):
        active = tuple(i for i, n in enumerate(left) if n > 0)
        t0 = time.perf_counter()
        packed_train_step(packed, opt, [batch(i) for i in active], loss_fn=loss_fn)
        sync()
        step_s.append(time.perf_counter() - t0)
        first.append(active not in seen)
        comps.append(active)
        seen.add(active)
        for i in active:
            left[i] -= 1
    return {"pack_steps": len(step_s), **steady_split(step_s, first, comps)}


def steady_split(step_s: list[float], first: list[bool], comps: list) -> dict:
    """(`steady_s`, `first_use_s`) of timed steps: see `train_pack`."""
    later = [t for t, f in zip(step_s, first, strict=True) if not f]
    steady = 0.0
    for t, f, c in zip(step_s, first, comps, strict=True):
        if f:
            same = [u for u, g, d in zip(step_s, first, comps, strict=True) if d == c and not g]
            t = statistics.median(same or later or [t])
        steady += t
    return {
        "steady_s": steady,
        "first_use_s": sum(step_s) - steady,
        "compositions": len(set(comps)),
    }


def run_packed(model, jobs, compiled: bool = False) -> dict:
    """One pack (one GPU, everything fits): jobs leave the pack as they finish. `compiled`:
    the forward and loss through `compiled_loss` (a cold compile: Dynamo reset first; the
    compiles land in `first_use_s`, each new composition's first step)."""
    sync()
    begin = time.perf_counter()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="triton"))
    loss_fn = packed_loss(compiled)
    try:
        opt = PerAdapterOptimizer(packed)
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(jobs))]

        def batch(i):
            shape = (jobs[i].batch_size, SEQ + 1)
            return i, torch.randint(0, MODEL["vocab_size"], shape, generator=gens[i])

        timed = train_pack(packed, opt, batch, [j.steps for j in jobs], loss_fn)
        sync()
    finally:
        packed.remove()
        if compiled:
            torch._dynamo.reset()
    wall = time.perf_counter() - begin
    tokens = sum(j.steps * j.batch_size * SEQ for j in jobs)
    kind = "packed_compiled" if compiled else "packed"
    return {"kind": kind, "jobs": len(jobs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, **timed,
            "steady_tokens_per_s": tokens / timed["steady_s"]}  # fmt: skip


def run_sequential(model, jobs) -> dict:
    """Each job alone with peft, one after another (wrapping and unwrapping included)."""
    sync()
    begin = time.perf_counter()
    for i, job in enumerate(jobs):
        peft_model, params, opt = peft_wrap(model, job)
        gen = torch.Generator().manual_seed(100 + i)
        for _ in range(job.steps):
            ids = torch.randint(0, MODEL["vocab_size"], (job.batch_size, SEQ + 1), generator=gen)
            peft_step(peft_model, params, opt, job, ids)
        peft_model.unload()
    sync()
    wall = time.perf_counter() - begin
    tokens = sum(j.steps * j.batch_size * SEQ for j in jobs)
    return {"kind": "sequential_peft", "jobs": len(jobs), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}  # fmt: skip


def bench_makespan(model, jobs, rows: list | None = None) -> list[dict]:
    """Packed and sequential runs, appended to `rows` (main's: a partial write keeps them)."""
    rows = [] if rows is None else rows
    for n in MAKESPAN_JOBS:
        steps = sum(j.steps for j in jobs[:n])
        for compiled in packing_modes():
            kind = "packed_compiled" if compiled else "packed"
            rows.append(_guarded(lambda n=n, c=compiled: run_packed(model, jobs[:n], c),
                                 {"kind": kind, "jobs": n},
                                 f"makespan: {kind}, {n} jobs ({steps} job steps)"))  # fmt: skip
        if ARGS.no_sequential:
            continue
        rows.append(_guarded(lambda n=n: run_sequential(model, jobs[:n]),
                             {"kind": "sequential_peft", "jobs": n},
                             f"makespan: sequential peft, {n} jobs ({steps} steps)"))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------
# baseline: sequential peft jobs at their best (issue 19): compiled, micro-batches that fill
# the GPU; rates per (rank, micro-batch, variant), turned into makespans in the summary
# ---------------------------------------------------------------------------------------

HEADROOM = 0.85  # of the device's memory a baseline micro-batch may peak at (probe)


def compile_settings() -> dict:
    """How the compiled baseline is compiled: Inductor on the GPU (--baseline-mode passed
    on); in smoke Dynamo with the eager backend (graph capture, no code generation: Inductor
    on a CPU would take minutes)."""
    backend = ARGS.baseline_backend or ("eager" if ARGS.smoke else "inductor")
    return {"backend": backend, "mode": ARGS.baseline_mode if backend == "inductor" else None,
            "what": "torch.compile of the peft model's forward + loss (backward through "
                    "AOTAutograd where the backend has it), fused AdamW and clipping eager"}  # fmt: skip


def baseline_job(rank: int, micro_batch: int) -> LoraJobConfig:
    return LoraJobConfig(f"baseline-r{rank}-b{micro_batch}", rank, 2.0 * rank, 1e-4, micro_batch,
                         steps=1)  # fmt: skip


def baseline_peak(model, rank: int, micro_batch: int) -> int | None:
    """Peak memory (bytes) of one eager peft step at `micro_batch` samples; None when it
    runs out of memory (the probe's measure)."""
    job = baseline_job(rank, micro_batch)
    peft_model, params, opt = peft_wrap(model, job)
    peak = None
    try:
        ids = token_batches([job])[0][1]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        peft_step(peft_model, params, opt, job, ids)
        sync()
        peak = int(torch.cuda.max_memory_allocated())
    except torch.cuda.OutOfMemoryError:
        pass  # the exception (and the tensors its frames hold) is gone after this block
    finally:
        opt.zero_grad(set_to_none=True)
        peft_model.unload()
    torch.cuda.empty_cache()
    got = "out of memory" if peak is None else f"peak {peak / 2**30:.1f} GiB"
    log(f"baseline: probe r{rank} micro-batch {micro_batch}: {got}")
    return peak


def baseline_probe(model, rank: int) -> dict:
    """The largest power-of-two micro-batch <= CAP whose eager step peaks within HEADROOM
    of the device's memory (`probe_batch_size`); on the CPU (smoke) the cap, unprobed."""
    row = {"kind": "baseline_probe", "rank": rank, "cap": CAP}
    if DEVICE.type != "cuda":
        return {**row, "micro_batch": CAP, "budget_bytes": None, "peaks": {},
                "note": "CPU: no memory probe, the cap"}  # fmt: skip
    budget = HEADROOM * torch.cuda.get_device_properties(DEVICE).total_memory
    batch, peaks = probe_batch_size(lambda b: baseline_peak(model, rank, b), budget, CAP)
    return {**row, "micro_batch": batch, "budget_bytes": int(budget),
            "peaks": {str(b): p for b, p in sorted(peaks.items())}}  # fmt: skip


def baseline_rate(model, rank: int, micro_batch: int, variant: str) -> dict:
    """Steady-state rate of one peft job (rank, micro_batch) trained `variant` ("eager" or
    "compiled"): the first step timed apart (for "compiled" it compiles the forward and,
    at its backward, the backward: compile_s = first step - steady step), then WARMUP
    (at least 1 when compiled) untimed and TIMED timed steps; one loss sync per step, as in
    a trainer that logs its loss and in the packed step."""
    job = baseline_job(rank, micro_batch)
    compiled = variant == "compiled"
    settings = compile_settings() if compiled else {"backend": None, "mode": None}
    peft_model, params, opt = peft_wrap(model, job)
    try:
        loss_fn = None
        if compiled:
            torch._dynamo.reset()  # a cold compile per shape, and no recompile limit hit

            def loss_of(ids):
                return peft_loss(peft_model, ids)

            kwargs = {"mode": settings["mode"]} if settings["mode"] else {}
            loss_fn = torch.compile(loss_of, backend=settings["backend"], dynamic=False, **kwargs)
        ids = token_batches([job], seed=micro_batch)[0][1]
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        begin = time.perf_counter()
        peft_step(peft_model, params, opt, job, ids, loss_fn)
        sync()
        first = time.perf_counter() - begin
        log(f"baseline: r{rank} micro-batch {micro_batch} {variant}: first step "
            f"{'(compile) ' if compiled else ''}{first:.1f} s")  # fmt: skip
        for _ in range(max(WARMUP - 1, 1 if compiled else 0)):
            peft_step(peft_model, params, opt, job, ids, loss_fn)
        sync()
        begin = time.perf_counter()
        for _ in range(TIMED):
            peft_step(peft_model, params, opt, job, ids, loss_fn)
        sync()
        step = (time.perf_counter() - begin) / TIMED
        peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0
    finally:
        opt.zero_grad(set_to_none=True)
        peft_model.unload()
        if compiled:
            torch._dynamo.reset()
    return {
        "kind": "baseline_rate", "rank": rank, "micro_batch": micro_batch, "variant": variant,
        "compile_backend": settings["backend"], "compile_mode": settings["mode"], "seq_len": SEQ,
        "tokens": micro_batch * SEQ, "step_time_s": step, "samples_per_s": micro_batch / step,
        "tokens_per_s": micro_batch * SEQ / step, "first_step_s": first,
        "compile_s": max(first - step, 0.0) if compiled else 0.0,
        "peak_memory_bytes": int(peak), "device": str(DEVICE),
    }  # fmt: skip


def bench_baseline(model, jobs, rows: list | None = None) -> list[dict]:
    """Rates for every (rank, batch size) pair of `jobs`, cheapest and most telling first
    (work past the budget is recorded as skipped, and so is a rate when less of the budget
    is left than the longest of its variant took so far, e.g. a compile): eager at the
    job's own batch (the old baseline), the largest micro-batch that fits per rank (probe),
    eager and compiled at it, then compiled at each own batch. Rows are appended to `rows`
    (main's: a partial write keeps those done)."""
    only = {int(r) for r in ARGS.baseline_ranks.split(",")} if ARGS.baseline_ranks else None
    pairs = sorted({(j.rank, j.batch_size) for j in jobs if only is None or j.rank in only})
    ranks = sorted({r for r, _ in pairs})
    rows, done = [] if rows is None else rows, set()
    longest: dict[str, float] = {}  # variant -> the longest rate of it so far (seconds)

    def rate(rank, micro_batch, variant):
        if (rank, micro_batch, variant) in done:
            return
        done.add((rank, micro_batch, variant))
        context = {"kind": "baseline_rate", "rank": rank, "micro_batch": micro_batch,
                   "variant": variant}  # fmt: skip
        row = _guarded(lambda: baseline_rate(model, rank, micro_batch, variant), context,
                       f"baseline: r{rank} micro-batch {micro_batch} {variant}",
                       need_s=longest.get(variant, 0.0))  # fmt: skip
        if "error" not in row:
            longest[variant] = max(longest.get(variant, 0.0), _LAST_UNIT_S)
        rows.append(row)

    for rank, batch in pairs:
        rate(rank, batch, "eager")
    largest = {}
    for rank in ranks:
        row = _guarded(lambda r=rank: baseline_probe(model, r),
                       {"kind": "baseline_probe", "rank": rank},
                       f"baseline: probe r{rank} (micro-batch cap {CAP})")  # fmt: skip
        rows.append(row)
        if row.get("micro_batch"):
            largest[rank] = row["micro_batch"]
    for rank, batch in sorted(largest.items()):
        rate(rank, batch, "eager")
        rate(rank, batch, "compiled")
    if not ARGS.baseline_largest_only:
        for rank, batch in pairs:
            rate(rank, batch, "compiled")
    return rows


def baseline_rates(rows) -> list[dict]:
    return [r for r in rows if r.get("kind") == "baseline_rate" and "error" not in r]


def fair_makespans(rates, jobs, num_gpus: int = 1) -> dict:
    """Sequential makespan of `jobs` under each policy of `fair_sequential_makespan`."""
    return {p: fair_sequential_makespan(jobs, rates, SEQ, policy=p, num_gpus=num_gpus)
            for p in BASELINE_POLICIES}  # fmt: skip


# ---------------------------------------------------------------------------------------
# plan: the planner's schedule, run pack by pack; predicted vs measured makespan
# ---------------------------------------------------------------------------------------


def plan_jobs(jobs: list[LoraJobConfig]) -> list[LoraJobConfig]:
    """The jobs with --plan-lengths cycled over them (the run's length when not given)."""
    text = ARGS.plan_lengths or ("8,4" if ARGS.smoke else None)
    if not text:
        return list(jobs)
    lengths = [int(v) for v in text.split(",")]
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--plan-lengths takes positive integers, got {text!r}")
    return [replace(j, seq_len=lengths[n % len(lengths)]) for n, j in enumerate(jobs)]


def plan_models(model, steps: list[dict], base_jobs, jobs) -> tuple[ThroughputModel, MemoryModel]:
    """Step times fit on this run's packed Triton step profiles (packs of the first n of
    `base_jobs`), else on a few packs profiled here; memory calibrated on their measured
    peaks where there are some (a GPU), else the analytic estimate."""
    memory = MemoryModel(ModelShape.from_hf_config(model.config), seq_len=SEQ)
    records = [r for r in steps if "error" not in r and r["kind"] == "packed"
               and r["backend"] == "triton"]  # fmt: skip
    if len(records) >= 2:
        throughput = ThroughputModel.fit(
            records, source=f"fit on this run's {len(records)} packed steps"
        )
        packs = [base_jobs[: r["n_adapters"]] for r in records]
        keep = [k for k, r in enumerate(records)
                if r["tokens"] == sum(j.tokens_per_step(SEQ) for j in packs[k])]  # fmt: skip
        records, packs = [records[k] for k in keep], [packs[k] for k in keep]
    else:
        throughput, profiles, packs = profile_throughput(
            model, jobs, SEQ, config=PackedLoraConfig(backend="triton"), max_jobs=8, steps=TIMED
        )
        records = [p.to_dict() for p in profiles]
    if any(r.get("peak_memory_bytes") for r in records):  # none on the CPU: stay analytic
        memory = memory.calibrated(records, packs)
    return throughput, memory


def run_pack(model, jobs: list[LoraJobConfig], seed: int) -> dict:
    """Train one pack to its jobs' step counts (each job at its own length), jobs leaving
    as they finish, after one untimed warm-up step of the whole pack."""
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="triton"))
    try:
        opt = PerAdapterOptimizer(packed)
        gens = [torch.Generator().manual_seed(seed + i) for i in range(len(jobs))]
        lengths = [j.length(SEQ) for j in jobs]

        def batch(i):
            shape = (jobs[i].batch_size, lengths[i] + 1)
            return i, torch.randint(0, MODEL["vocab_size"], shape, generator=gens[i])

        packed_train_step(packed, opt, [batch(i) for i in range(len(jobs))])  # warm-up
        sync()
        begin = time.perf_counter()
        timed = train_pack(packed, opt, batch, [j.num_steps(SEQ) for j in jobs])
        wall = time.perf_counter() - begin
    finally:
        packed.remove()
    return {"measured_s": wall, **timed}


def bench_plan(
    model, jobs, steps: list[dict], rows: list | None = None
) -> tuple[list[dict], list[dict]]:
    """Plan `jobs`, run every pack of the schedule; returns (rows, the schedule's rows).
    Rows are appended to `rows` (main's: a partial write keeps the packs done)."""
    base_jobs, jobs = jobs, plan_jobs(jobs)
    log("plan: step time and memory models ...")
    throughput, memory = plan_models(model, steps, base_jobs, jobs)
    log(f"plan: models ready ({throughput.source}); planning {len(jobs)} jobs on "
        f"{ARGS.plan_gpus} GPU(s) ...")  # fmt: skip
    if DEVICE.type == "cuda":
        gpu_memory = torch.cuda.get_device_properties(DEVICE).total_memory
    else:
        gpu_memory = 1024**4  # no limit that matters on the CPU
    begin = time.perf_counter()
    plan = plan_lora_jobs(jobs, memory, throughput, gpu_memory_bytes=gpu_memory,
                          num_gpus=ARGS.plan_gpus)  # fmt: skip
    planning_s = time.perf_counter() - begin
    schedule = plan.schedule.filter(plan.schedule["status"] == "planned")
    log(f"plan: {plan.solver} in {planning_s:.1f} s, predicted makespan {plan.makespan_s:.1f} s")
    by_name = {j.name: j for j in jobs}
    rows = [] if rows is None else rows
    measured_by_gpu, steady_by_gpu, sched_rows = {}, {}, []
    for (gpu, order), group in schedule.sort(["gpu", "pack_order"]).group_by(
        ["gpu", "pack_order"], maintain_order=True
    ):
        names = group["job"].to_list()
        predicted = float(group["pack_end_s"][0] - group["pack_start_s"][0])
        context = {"kind": "plan_pack", "gpu": gpu, "pack_order": order, "jobs": names,
                   "predicted_s": predicted}  # fmt: skip
        label = f"plan: GPU {gpu} pack {order} ({len(names)} jobs, predicted {predicted:.1f} s)"
        row = _guarded(lambda n=names, g=gpu, o=order: run_pack(model, [by_name[x] for x in n],
                                                                 seed=1000 * g + 100 * o), context, label)  # fmt: skip
        row = {**context, **row}
        if "measured_s" in row:
            row["measured_over_predicted"] = row["measured_s"] / predicted
            measured_by_gpu[gpu] = measured_by_gpu.get(gpu, 0.0) + row["measured_s"]
            steady_by_gpu[gpu] = steady_by_gpu.get(gpu, 0.0) + row["steady_s"]
        rows.append(row)
        for r in group.iter_rows(named=True):
            sched_rows.append({**r, "measured_pack_s": row.get("measured_s")})
    complete = all("measured_s" in r for r in rows) and rows
    measured = max(measured_by_gpu.values()) if complete else None
    steady = max(steady_by_gpu.values()) if complete else None
    rows.append({
        "kind": "plan", "jobs": len(jobs), "gpus": ARGS.plan_gpus, "packs": len(rows),
        "solver": plan.solver, "planning_s": planning_s,
        "throughput_source": throughput.source, "memory_source": memory.source,
        "predicted_makespan_s": plan.makespan_s,
        "predicted_baseline_makespan_s": plan.baseline_makespan_s,
        "measured_makespan_s": measured,
        "measured_by_gpu_s": measured_by_gpu,
        "predicted_over_measured": plan.makespan_s / measured if measured else None,
        # The planner's step times are steady ones: first-use tuning of a new pack
        # composition's kernels apart (`train_pack`).
        "measured_steady_makespan_s": steady,
        "predicted_over_measured_steady": plan.makespan_s / steady if steady else None,
        "unfit": plan.unfit, "lengths": sorted({j.length(SEQ) for j in jobs}),
    })  # fmt: skip
    return rows, sched_rows


# ---------------------------------------------------------------------------------------
# summary, metadata, output
# ---------------------------------------------------------------------------------------


def summarize(kernels, steps, makespans, jobs, plan_rows=(), baseline=()) -> dict:
    ok_steps = [r for r in steps if "error" not in r]
    packed = {
        (r["backend"], r["n_adapters"]): r
        for r in ok_steps
        if r["kind"] == "packed"
        and r["tokens"] == sum(j.batch_size * SEQ for j in jobs[: r["n_adapters"]])
    }
    solo = {(r["rank"], r["batch_size"]): r for r in ok_steps if r["kind"] == "solo_peft"}
    summary: dict = {"throughput": [], "makespan": [], "kernels": [], "loop_vs_triton_step": []}
    rates = baseline_rates(baseline)
    if baseline:
        summary["baseline"] = summarize_baseline(baseline, rates, jobs)
    for n in JOB_COUNTS:
        row = packed.get(("triton", n))
        group = jobs[:n]
        if row is None or not all((j.rank, j.batch_size) in solo for j in group):
            continue
        seq_time = sum(solo[(j.rank, j.batch_size)]["step_time_s"] for j in group)
        seq_tps = sum(j.batch_size * SEQ for j in group) / seq_time
        per_bs = {}
        for b in BATCH_SIZES:
            rows_b = [solo[(j.rank, j.batch_size)] for j in group if j.batch_size == b]
            if rows_b:
                per_bs[b] = row["tokens_per_s"] / (
                    sum(r["tokens"] for r in rows_b) / sum(r["step_time_s"] for r in rows_b)
                )
        summary["throughput"].append({
            "jobs": n, "packed_tokens_per_s": row["tokens_per_s"], "sequential_tokens_per_s": seq_tps,
            "ratio": row["tokens_per_s"] / seq_tps, "ratio_by_batch_size": per_bs,
            **fair_throughput(rates, group, row["tokens_per_s"]),
        })  # fmt: skip
        loop = packed.get(("loop", n))
        if loop is not None:
            summary["loop_vs_triton_step"].append({"jobs": n, "triton_step_s": row["step_time_s"],
                                                   "loop_step_s": loop["step_time_s"],
                                                   "ratio": loop["step_time_s"] / row["step_time_s"]})  # fmt: skip
    by = {(r["kind"], r["jobs"]): r for r in makespans if "error" not in r}
    summary["packed_vs_compiled_peft"] = packed_vs_compiled_peft(by, rates)
    for n in JOB_COUNTS:
        p, s = by.get(("packed", n)), by.get(("sequential_peft", n))
        if p and s:
            steady = against_baselines(rates, jobs[:n], p.get("steady_s"))
            summary["makespan"].append({"jobs": n, "packed_s": p["wall_s"], "sequential_s": s["wall_s"],
                                        "ratio": s["wall_s"] / p["wall_s"],
                                        "tokens_per_s_ratio": p["tokens_per_s"] / s["tokens_per_s"],
                                        **against_baselines(rates, jobs[:n], p["wall_s"]),
                                        "packed_steady_s": p.get("steady_s"),
                                        "packed_first_use_s": p.get("first_use_s"),
                                        **{f"{k}_steady": v for k, v in steady.items()
                                           if k.startswith("ratio_vs_")}})  # fmt: skip
    for r in kernels:
        if "error" not in r:
            keys = ("shape", "t_triton_ms", "t_loop_ms", "t_base_ms", "loop_over_triton", "ok",
                    "fused_over_unfused", "fused_base_over_unfused", "aim_adapter_over_base",
                    *(f"{m}{p}" for p in PATHS for m in ("adapter_over_base_", "adapter_over_base_op_",
                                                         "adapter_over_base_device_")))  # fmt: skip
            summary["kernels"].append({k: r.get(k) for k in keys})
    summary["plan"] = [
        {**{k: r[k] for k in ("jobs", "gpus", "packs", "solver", "predicted_makespan_s",
                              "measured_makespan_s", "predicted_over_measured",
                              "measured_steady_makespan_s", "predicted_over_measured_steady")},
         **against_baselines(rates, plan_jobs(jobs), r["measured_makespan_s"], r["gpus"])}
        for r in plan_rows if r["kind"] == "plan"
    ]  # fmt: skip
    return summary


def packed_vs_compiled_peft(by: dict, rates: list[dict]) -> list[dict]:
    """Each packed makespan run's steady tokens/s (eager and compiled packing) against the
    best compiled peft rate measured (one job alone, its largest micro-batch: what a
    sequential trainer at its best runs at), and compiled packing against eager packing."""
    compiled = [r for r in rates if r["variant"] == "compiled"]
    best = max(compiled, key=lambda r: r["tokens_per_s"], default=None)
    out = []
    for (kind, n), row in sorted(by.items()):
        tps = row.get("steady_tokens_per_s")
        if not kind.startswith("packed") or not tps:
            continue
        entry = {"kind": kind, "jobs": n, "steady_tokens_per_s": tps,
                 "first_use_s": row["first_use_s"], "steady_s": row["steady_s"]}  # fmt: skip
        if best is not None:
            entry |= {"compiled_peft_tokens_per_s": best["tokens_per_s"],
                      "compiled_peft": f"r{best['rank']} micro-batch {best['micro_batch']}",
                      "ratio_vs_compiled_peft": tps / best["tokens_per_s"]}  # fmt: skip
        eager = by.get(("packed", n))
        if kind == "packed_compiled" and eager:
            entry["ratio_vs_eager_packing"] = tps / eager["steady_tokens_per_s"]
        out.append(entry)
    return out


def against_baselines(rates, jobs, packed_s: float | None, num_gpus: int = 1) -> dict:
    """PLoRA's measured makespan `packed_s` against the sequential makespans of `jobs` from
    the baseline rates: eager at each job's own batch (the old baseline, steady state), the
    best variant at the own batch (same optimizer steps), and the fair one (best variant
    and micro-batch; compile time once per shape, apart and included). Ratio = sequential
    / packed (> 1: PLoRA is faster). {} without rates."""
    if not rates:
        return {}
    out = {"approx_lengths": any(j.length(SEQ) != SEQ for j in jobs)}
    for policy, fair in fair_makespans(rates, jobs, num_gpus).items():
        seq_s = fair["makespan_s"]
        out[f"{policy}_sequential_s"] = seq_s
        out[f"ratio_vs_{policy}"] = seq_s / packed_s if seq_s and packed_s else None
        if policy == "best":
            with_compile = fair["makespan_with_compile_s"]
            out["best_compile_s"] = fair["compile_s"]
            whole = fair["makespan_whole_steps_s"]
            out["best_whole_steps_s"] = whole  # every step of the micro-batch in full
            out["ratio_vs_best_whole_steps"] = whole / packed_s if whole and packed_s else None
            out["ratio_vs_best_with_compile"] = (with_compile / packed_s
                                                 if with_compile and packed_s else None)  # fmt: skip
            out["best_missing"] = fair["missing"]
    return out


def fair_throughput(rates, jobs, packed_tokens_per_s: float) -> dict:
    """One step of every job (the steps section's throughput): sequential tokens/s at each
    job's best rate (policy "best"), and packed over it. {} without rates."""
    if not rates:
        return {}
    fair = fair_sequential_makespan([replace(j, steps=1, tokens=None) for j in jobs], rates, SEQ)
    if fair["missing"]:
        return {"fair_missing": fair["missing"]}
    tps = sum(r["tokens"] for r in fair["jobs"]) / fair["total_s"]
    return {"fair_sequential_tokens_per_s": tps, "ratio_vs_fair": packed_tokens_per_s / tps}


def summarize_baseline(rows, rates, jobs) -> dict:
    """The rates (samples/s by rank, micro-batch, variant; compile time), the probed largest
    micro-batch per rank, and the sequential makespan of the first n jobs per policy."""
    largest = {r["rank"]: r.get("micro_batch") for r in rows
               if r.get("kind") == "baseline_probe" and "error" not in r}  # fmt: skip
    by_jobs = []
    for n in JOB_COUNTS:
        entry = {"jobs": n}
        for policy, fair in fair_makespans(rates, jobs[:n]).items():
            entry[policy] = {k: fair[k] for k in ("makespan_s", "makespan_whole_steps_s", "compile_s",
                                                  "makespan_with_compile_s",
                                                  "optimizer_steps", "optimizer_steps_at_micro_batch",
                                                  "missing")}  # fmt: skip
        by_jobs.append(entry)
    keep = ("rank", "micro_batch", "variant", "samples_per_s", "tokens_per_s", "step_time_s",
            "compile_s", "peak_memory_bytes")  # fmt: skip
    return {"rates": [{k: r[k] for k in keep} for r in rates], "largest_micro_batch": largest,
            "compile": compile_settings(), "by_jobs": by_jobs,
            "errors": [{k: v for k, v in r.items() if k != "trace"} for r in rows if "error" in r]}  # fmt: skip


def run_metadata(wall: float) -> dict:
    return metadata(DEVICE, mode=MODE,
        transformers=version("transformers"), peft=version("peft"),
        model=MODEL, seq_len=SEQ, dtype=str(DTYPE), autotune=not ARGS.no_autotune,
        timed_steps=TIMED, warmup_steps=WARMUP, wall_s=wall,
        baseline="peft LoraConfig defaults (fp32 adapters), fused AdamW, grad clipping, one job at a time",
        packed="loka PackedLoraConfig defaults (fp32 adapters, bf16 GEMMs), per-adapter fused AdamW and clipping",
        fair_baseline={"compile": compile_settings(), "micro_batch_cap": CAP, "memory_headroom": HEADROOM,
                       "policies": {"eager_own": "eager peft at the job's own batch (steady state)",
                                    "own": "best of eager/compiled at the job's own batch: the job's own optimizer steps",
                                    "best": "best of eager/compiled at the own batch or the largest power-of-two "
                                            "micro-batch that fits: the same samples in ceil(samples / micro-batch) "
                                            "steps (fewer, bigger steps: a different optimization, lr not rescaled)"},
                       "time": "samples x seq_len / steady-state tokens/s per job (a lower bound); compile "
                               "time once per (rank, micro-batch, variant) shape, reported apart"},
    )  # fmt: skip


def print_summary(summary: dict) -> None:
    print("\nPLoRA summary (ratios measured in this run)")
    for r in summary["kernels"]:
        print(f"  kernel {r['shape']:8s} triton {r['t_triton_ms']:8.3f} ms  loop {r['t_loop_ms']:8.3f} ms  "
              f"base {r['t_base_ms']:8.3f} ms  loop/triton {r['loop_over_triton']:5.2f}x  ok={r['ok']}")  # fmt: skip
        for p in PATHS:
            device = r.get(f"adapter_over_base_device_{p}")
            device = "n/a" if device is None else f"{device:6.1%}"
            print(f"    adapters/base {p:10s} step-like {r[f'adapter_over_base_{p}']:7.1%}  op "
                  f"{r[f'adapter_over_base_op_{p}']:7.1%}  device {device}  (aim <= {AIM:.0%})")  # fmt: skip
    for r in summary["loop_vs_triton_step"]:
        print(f"  step {r['jobs']:2d} jobs: triton {r['triton_step_s'] * 1e3:8.1f} ms  loop {r['loop_step_s'] * 1e3:8.1f} ms  "
              f"loop/triton {r['ratio']:5.2f}x")  # fmt: skip
    for r in summary["throughput"]:
        per_bs = "  ".join(f"bs{b}: {v:.2f}x" for b, v in r["ratio_by_batch_size"].items())
        print(f"  throughput {r['jobs']:2d} jobs: packed {r['packed_tokens_per_s']:9.0f} tok/s  sequential "
              f"{r['sequential_tokens_per_s']:9.0f} tok/s  {r['ratio']:5.2f}x  ({per_bs})")  # fmt: skip
    for r in summary["makespan"]:
        print(f"  makespan {r['jobs']:2d} jobs: packed {r['packed_s']:7.2f} s (steady {r['packed_steady_s']:7.2f} s, "
              f"first use {r['packed_first_use_s']:6.2f} s)  sequential {r['sequential_s']:7.2f} s  "
              f"{r['ratio']:5.2f}x shorter")  # fmt: skip
    for r in summary.get("plan", []):
        measured = r["measured_makespan_s"]
        tail = (f"measured {measured:7.2f} s  predicted/measured {r['predicted_over_measured']:5.2f}  "
                f"(steady {r['measured_steady_makespan_s']:7.2f} s: {r['predicted_over_measured_steady']:5.2f})"
                if measured else "measured: incomplete (see errors)")  # fmt: skip
        print(f"  plan {r['jobs']:2d} jobs on {r['gpus']} GPU(s), {r['packs']} packs ({r['solver']}): "
              f"predicted {r['predicted_makespan_s']:7.2f} s  {tail}")  # fmt: skip
    for r in summary.get("packed_vs_compiled_peft", []):
        vs_peft = (f"  vs compiled peft ({r['compiled_peft']}) {_x(r['ratio_vs_compiled_peft'])}"
                   if "ratio_vs_compiled_peft" in r else "")  # fmt: skip
        vs_eager = (f"  vs eager packing {_x(r['ratio_vs_eager_packing'])}"
                    if "ratio_vs_eager_packing" in r else "")  # fmt: skip
        print(f"  {r['kind']:16s} {r['jobs']:2d} jobs: steady {r['steady_tokens_per_s']:9.0f} tok/s "
              f"(first use {r['first_use_s']:6.2f} s){vs_peft}{vs_eager}")  # fmt: skip
    base = summary.get("baseline")
    if base:
        print_baseline(base, summary)


def _x(value) -> str:
    return "  n/a" if value is None else f"{value:5.2f}x"


def _s(value) -> str:
    return "    n/a" if value is None else f"{value:7.2f}"


def print_baseline(base: dict, summary: dict) -> None:
    compile_ = base["compile"]
    print(f"  fair baseline: peft alone, eager or torch.compile (backend {compile_['backend']}, mode "
          f"{compile_['mode'] or ('default' if compile_['backend'] == 'inductor' else 'n/a')}), largest micro-batch by rank {base['largest_micro_batch']}")  # fmt: skip
    for r in base["rates"]:
        print(f"    rate r{r['rank']:<3d} micro-batch {r['micro_batch']:3d} {r['variant']:8s} "
              f"{r['samples_per_s']:9.2f} samples/s  compile {r['compile_s']:6.2f} s")  # fmt: skip
    for r in base["by_jobs"]:
        parts = "  ".join(f"{p} {_s(r[p]['makespan_s'])} s" for p in BASELINE_POLICIES)
        print(f"    sequential {r['jobs']:2d} jobs: {parts}  (best + compile "
              f"{_s(r['best']['makespan_with_compile_s'])} s; steps {r['best']['optimizer_steps']} -> "
              f"{r['best']['optimizer_steps_at_micro_batch']})")  # fmt: skip
    for r in summary["makespan"]:
        if "ratio_vs_best" in r:
            print(f"    makespan {r['jobs']:2d} jobs: packed vs eager own batch {_x(r['ratio_vs_eager_own'])}  "
                  f"vs compiled own batch {_x(r['ratio_vs_own'])}  vs fair {_x(r['ratio_vs_best'])}  "
                  f"(whole steps {_x(r['ratio_vs_best_whole_steps'])}, + compile "
                  f"{_x(r['ratio_vs_best_with_compile'])})")  # fmt: skip
    for r in summary["throughput"]:
        if "ratio_vs_fair" in r:
            print(
                f"    throughput {r['jobs']:2d} jobs: packed vs fair sequential {_x(r['ratio_vs_fair'])}"
            )
    for r in summary.get("plan", []):
        if "ratio_vs_best" in r:
            approx = (
                " (lengths differ from the rates': tokens at the rates' tokens/s)"
                if r["approx_lengths"]
                else ""
            )
            print(f"    plan {r['jobs']:2d} jobs on {r['gpus']} GPU(s): vs eager own batch "
                  f"{_x(r['ratio_vs_eager_own'])}  vs fair {_x(r['ratio_vs_best'])}{approx}")  # fmt: skip


SECTIONS = ("kernels", "steps", "baseline", "makespan", "profile", "plan")  # run in this order
STEP_FIELDS = ["kind", "backend", "n_adapters", "rank", "batch_size", "tokens", "rank_tokens",
               "step_time_s", "tokens_per_s", "peak_memory_bytes", "device"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    global _CHECKPOINT
    configure(parse_args(argv))
    if DEVICE.type != "cuda" and not ARGS.smoke:
        raise SystemExit("bench/plora.py needs a CUDA GPU; use --smoke on CPU")
    if ARGS.no_autotune:
        os.environ["LOKA_KERNELS_AUTOTUNE"] = "0"
    sections = set(ARGS.sections.split(","))
    order = [s for s in SECTIONS if s in sections]
    out = Path(ARGS.out)
    stamp = utc_stamp()
    json_path = out / f"plora_{MODE}_{stamp}.json"
    steps_path = out / f"plora_steps_{MODE}_{stamp}.csv"
    schedule_path = out / f"plora_schedule_{MODE}_{stamp}.csv"
    jobs = make_jobs(max(JOB_COUNTS))
    res: dict[str, list] = {k: [] for k in (*SECTIONS, "schedule")}
    state: dict = {"done": [], "running": None}

    def record(complete: bool) -> dict:
        kernels, steps, baseline = res["kernels"], res["steps"], res["baseline"]
        makespans, plan_rows = res["makespan"], res["plan"]
        summary = summarize(kernels, steps, makespans, jobs, plan_rows, baseline)
        return {"meta": run_metadata(BUDGET.elapsed()), "complete": complete,
                "sections": order, "sections_done": list(state["done"]),
                "section_running": state["running"],
                "jobs": [j.to_dict() for j in jobs], "kernels": kernels, "steps": steps,
                "makespan": makespans, "plan": plan_rows, "baseline": baseline,
                "profile": res["profile"],
                "baseline_makespans": {n: fair_makespans(baseline_rates(baseline), jobs[:n])
                                       for n in JOB_COUNTS} if baseline else {},
                "summary": summary}  # fmt: skip

    def save_partial() -> None:
        """The results so far ("complete": false); the step profiles and schedule too."""
        write_json(json_path, record(complete=False), indent=2)
        steps_ok = [r for r in res["steps"] if "error" not in r]
        if steps_ok:
            write_csv(steps_path, steps_ok, STEP_FIELDS)
        if res["schedule"]:
            write_csv(schedule_path, res["schedule"], list(res["schedule"][0]))

    def section(name: str, run) -> None:
        state["running"] = name
        log(f"{name}: start ({max(BUDGET.left(), 0.0):.0f} s of the budget left)")
        begin = time.monotonic()
        run()
        state["done"].append(name)
        state["running"] = None
        checkpoint()
        log(f"{name}: done in {time.monotonic() - begin:.0f} s (partial results: {json_path})")

    def plan() -> None:
        _, res["schedule"] = bench_plan(model, jobs, res["steps"], res["plan"])

    log(f"start: {MODE}, sections {','.join(order)}, budget {BUDGET.seconds:.0f} s, "
        f"device {DEVICE}; results {json_path}")  # fmt: skip
    _CHECKPOINT = save_partial
    try:
        if "kernels" in sections:
            section("kernels", lambda: res["kernels"].extend(bench_kernels(jobs)))
        model = None
        if sections & {"steps", "baseline", "makespan", "profile", "plan"}:
            log("model: building ...")
            model = build_model()
            size = sum(p.numel() for p in model.parameters()) / 1e9
            log(f"model: built ({size:.2f}B parameters)")
        if "steps" in sections:
            section("steps", lambda: bench_steps(model, jobs, res["steps"]))
        if "baseline" in sections:
            section("baseline", lambda: bench_baseline(model, jobs, res["baseline"]))
        if "makespan" in sections:
            section("makespan", lambda: bench_makespan(model, jobs, res["makespan"]))
        if "profile" in sections:
            section("profile", lambda: bench_profile(model, jobs, res["profile"], out, stamp))
        if "plan" in sections:
            section("plan", plan)
    finally:
        _CHECKPOINT = None
    kernels, steps, baseline = res["kernels"], res["steps"], res["baseline"]
    makespans, plan_rows, schedule = res["makespan"], res["plan"], res["schedule"]
    full = record(complete=True)
    summary = full["summary"]
    write_json(json_path, full, indent=2)
    rows = [r for r in steps if "error" not in r]
    write_csv(steps_path, rows, STEP_FIELDS)
    if schedule:
        write_csv(schedule_path, schedule, list(schedule[0]))
    print_summary(summary)
    print_profiles(res["profile"])
    errors = [r for r in (*kernels, *steps, *baseline, *makespans, *res["profile"], *plan_rows)
              if "error" in r]  # fmt: skip
    for r in errors:
        context = {k: v for k, v in r.items() if k not in ("error", "trace")}
        print(f"  error: {context}: {r['error']}")
    bad = [r["shape"] for r in kernels if "error" not in r and not r["ok"]]
    if bad:
        print(f"  CORRECTNESS FAILED for {bad}")
    also = f", plora_schedule_{MODE}_{stamp}.csv" if schedule else ""
    print(f"wrote {out}/plora_{MODE}_{stamp}.json, plora_steps_{MODE}_{stamp}.csv{also} "
          f"({BUDGET.elapsed():.0f} s)", flush=True)  # fmt: skip
    return 1 if bad or (errors and ARGS.smoke) else 0


if __name__ == "__main__":
    sys.exit(main())
