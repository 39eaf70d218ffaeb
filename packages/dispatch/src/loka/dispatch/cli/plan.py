"""`loka plan`: choose per site and pass the fastest safe kernel; write the plan table."""

from __future__ import annotations

import argparse
from pathlib import Path

from loka.dispatch.cli._common import fail, use_interpreter_without_gpu, user_errors


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan each GEMM site's kernels from probe tables and kernel_bench",
        description="Join site_errors (Probe) with kernel_bench: per site and pass the fastest "
        "candidate whose error is safe, never slower than bf16; every rejection with its reason.",
    )
    parser.add_argument("--tables", type=Path, required=True, help="probe tables folder")
    parser.add_argument("--kernel-bench", type=Path, default=None,
                        help="kernel_bench table (default: measure here, or estimate for the H200)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("plan.parquet"),
                        help="plan table to write (default plan.parquet)")  # fmt: skip
    parser.add_argument("--min-speedup", type=float, default=None,
                        help="speedup over bf16 every FP8 pass must reach (default 1.05)")  # fmt: skip
    parser.add_argument("--allow-fast-accum", action="store_true")
    parser.add_argument("--allow-undecided", action="store_true")
    parser.add_argument("--error-budget-total", type=float, default=None,
                        help="global budget: sum of error bounds over all FP8 passes")  # fmt: skip
    parser.add_argument("--gemm-share", type=float, default=None,
                        help="g for the end-to-end prediction when sites.time_share is empty")  # fmt: skip
    parser.add_argument("--exclude", action="append", default=[], help="site glob kept in bf16")
    parser.add_argument("--show", choices=("fp8", "all", "none"), default="fp8",
                        help="sites listed: those with a pass in FP8 (default), all, or none")  # fmt: skip
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print the full table: every pass with its backend, shape, "
                        "error bound and reason (the report has it too)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=180.0, help="bench budget if measuring")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out.is_dir():
        return fail(f"--out {args.out} is a directory; give the plan's file name (plan.parquet)")
    use_interpreter_without_gpu()
    from loka.dispatch.bench import (
        BenchCache,
        CostModel,
        benchmark,
        site_norm_shapes,
        site_producer_shapes,
        site_recipes,
        site_shapes,
    )
    from loka.dispatch.console import console, plan_lines, print_lines, print_plan, wrap_lines
    from loka.dispatch.planner import PlanConfig, make_plan
    from loka.dispatch.tables import load_probe_tables
    from loka.schema import read_table

    try:
        config = PlanConfig(
            min_speedup=args.min_speedup, allow_fast_accum=args.allow_fast_accum,
            allow_undecided=args.allow_undecided, error_budget_total=args.error_budget_total,
            exclude=tuple(args.exclude),
        )  # fmt: skip
        tables = load_probe_tables(args.tables)
        if args.kernel_bench is not None:
            bench = read_table(args.kernel_bench, "kernel_bench")
        else:
            sites = tables["sites"]
            result = benchmark(site_shapes(sites), cache=BenchCache(),
                               cost_model=CostModel.shipped(), budget_s=args.budget_s,
                               norm_shapes=site_norm_shapes(sites),
                               producer_shapes=site_producer_shapes(sites)
                               if config.mode != "eager" else (),
                               recipes=site_recipes(tables["site_errors"]),
                               charge_host=config.mode == "eager" and config.charge_host)  # fmt: skip
            for note in result.notes:
                console.print(f"bench: {note}")
            bench = result.table
        plan = make_plan(tables["sites"], tables["site_errors"], bench, config,
                         gemm_share=args.gemm_share)  # fmt: skip
    except user_errors() as exc:
        return fail(str(exc))
    if args.verbose and args.show != "none":
        print_plan(plan.table, only_fp8=args.show == "fp8")
    if args.show != "none":
        print_lines(plan_lines(plan.table, show_bf16=args.show == "all"))
    print_lines(wrap_lines(plan.summary.lines()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plan.write(args.out)
    console.print(f"wrote {args.out}")
    return 0
