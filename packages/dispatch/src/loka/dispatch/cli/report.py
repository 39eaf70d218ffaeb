"""`loka report`: one self-contained HTML page with the plan and its plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from loka.dispatch.cli._common import fail, user_errors


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write the plan report (one self-contained HTML file)",
        description="Per-site error against budget, the safe/unsafe x fast/slow map, speedup "
        "against shape, time share, and the plan with every rejection's reason.",
    )
    parser.add_argument("--tables", type=Path, required=True, help="probe tables folder")
    parser.add_argument("--plan", type=Path, required=True, help="plan table (loka plan)")
    parser.add_argument("--kernel-bench", type=Path, default=None, help="for the speed map")
    parser.add_argument("--out", type=Path, default=Path("loka-report.html"))
    parser.add_argument("--title", default="LoKA plan report")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loka.dispatch.console import console, progress_bar
    from loka.dispatch.report import write_report
    from loka.dispatch.tables import load_probe_tables, read_plan
    from loka.schema import read_table

    try:
        tables = load_probe_tables(args.tables)
        plan = read_plan(args.plan)
        bench = read_table(args.kernel_bench, "kernel_bench") if args.kernel_bench else None
        with progress_bar("rendering the report", 1) as update:
            path = write_report(args.out, sites=tables["sites"], site_errors=tables["site_errors"],
                                plan=plan.table, kernel_bench=bench, summary=plan.summary,
                                title=args.title)  # fmt: skip
            update(1)
    except user_errors() as exc:
        return fail(str(exc))
    console.print(f"wrote {path}")
    return 0
