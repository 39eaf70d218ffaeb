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
    parser.add_argument("--out", type=Path, default=Path("loka-report.html"),
                        help="HTML file to write (default loka-report.html)")  # fmt: skip
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
        _check_same_model(plan, tables["sites"], args.plan, args.tables)
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


def _check_same_model(plan, sites, plan_path: Path, tables_path: Path) -> None:
    """Refuse a plan made from another model's tables, as `apply` refuses a plan made for
    another model: the report would show one model's errors beside another's choices."""
    from loka.dispatch.planner import tables_fingerprint

    recorded = plan.metadata.get("model_fingerprint")
    if recorded is not None:
        ours = tables_fingerprint(sites)
        if recorded != ours:
            raise ValueError(
                f"{plan_path} was made for another model (plan fingerprint {recorded}, the "
                f"tables in {tables_path} have {ours}); plan from these tables, or pass the "
                "tables the plan was made from"
            )
        return
    # A plan without the fingerprint: its sites must at least be the tables' sites.
    missing = sorted(set(plan.table["site"]) - set(sites["site"]))
    if missing:
        raise ValueError(
            f"{plan_path} was made for another model: {len(missing)} of its sites are not in "
            f"the tables in {tables_path} (e.g. {', '.join(missing[:3])})"
        )
