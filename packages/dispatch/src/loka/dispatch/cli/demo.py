"""`loka demo`: a zoo model trained LoKA's way: bf16 warm-up with Probe, plan, apply,
continue; prints the plan and the speedup, writes the report."""

from __future__ import annotations

import argparse
from pathlib import Path

from loka.dispatch.cli._common import fail, use_interpreter_without_gpu


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="probe, plan, apply and keep training a zoo model; print the plan and speedup",
        description="On a GPU: the large preset, speed measured. On the CPU: the tiny preset, a "
        "minute or so, planned for the H200 from the shipped table (estimated, and said so).",
    )
    parser.add_argument("--model", default="dhen", help="zoo model (default dhen)")
    parser.add_argument("--preset", default=None, help="default: large on a GPU, tiny on CPU")
    parser.add_argument("--warmup-steps", type=int, default=None, help="bf16 steps with Probe")
    parser.add_argument("--steps", type=int, default=None, help="steps after applying the plan")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's weights and data (default 0)")  # fmt: skip
    parser.add_argument("--kernel-bench", type=Path, default=None,
                        help="plan from this kernel_bench table instead of measuring/estimating")  # fmt: skip
    parser.add_argument("--bench-budget-s", type=float, default=60.0,
                        help="seconds of kernel timing on a GPU (measured rows are cached)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("loka-demo"),
                        help="folder for the tables, the plan and report.html (default loka-demo)")  # fmt: skip
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print the plan's full table (every pass, with its reason)")  # fmt: skip
    parser.add_argument("--compile", action="store_true",
                        help="train the torch.compile'd model, as trainers do (a compiled plan)")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    use_interpreter_without_gpu()
    for name in ("warmup_steps", "steps"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "warmup_steps" else 0):
            return fail(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not args.bench_budget_s > 0:
        return fail(
            f"--bench-budget-s must be a positive number of seconds, got {args.bench_budget_s}"
        )
    if args.kernel_bench is not None and not args.kernel_bench.is_file():
        return fail(f"--kernel-bench: no such file {args.kernel_bench}")
    try:  # before any training: a run must not end by failing to write its results
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return fail(f"--out {args.out}: cannot create it ({exc.strerror or exc})")
    try:
        from loka.dispatch.demo import run_demo
    except ImportError as exc:
        return fail(f"loka demo needs loka-probe and loka-zoo (the demo extra): {exc}")
    try:
        run_demo(args.model, args.preset, warmup_steps=args.warmup_steps, steps=args.steps,
                 device=args.device, out=args.out, seed=args.seed,
                 kernel_bench=str(args.kernel_bench) if args.kernel_bench else None,
                 bench_budget_s=args.bench_budget_s, verbose=args.verbose,
                 compile=args.compile)  # fmt: skip
    except ValueError as exc:
        return fail(str(exc))
    return 0
