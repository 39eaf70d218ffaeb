"""Terminal output of the `loka` commands: rich progress bars and the plan as a table."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(highlight=False)


@contextmanager
def progress_bar(description: str, total: int | None = None) -> Iterator:
    """A progress bar; yields `update(done, total, text)`."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[detail]}"))  # fmt: skip
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(description, total=total, detail="")

        def update(done: int, of: int | None = None, detail: str = "") -> None:
            bar.update(task, completed=done, total=of if of is not None else total, detail=detail)

        yield update


def print_plan(plan: pl.DataFrame, *, limit: int = 60, only_fp8: bool = False) -> None:
    """One line per site and pass: what runs, how fast, how accurate, and why."""
    rows = plan.filter(pl.col("recipe") != "bf16") if only_fp8 else plan
    table = Table(title=f"plan: {plan['site'].n_unique()} sites, "
                  f"{plan.filter(pl.col('recipe') != 'bf16').height} FP8 passes")  # fmt: skip
    for name, justify in (("site", "left"), ("pass", "left"), ("backend / recipe", "left"),
                          ("M", "right"), ("K", "right"), ("N", "right"), ("speedup", "right"),
                          ("err", "right"), ("reason", "left")):  # fmt: skip
        table.add_column(name, justify=justify, overflow="fold")
    for r in rows.head(limit).iter_rows(named=True):
        style = "green" if r["recipe"] != "bf16" else None
        err = "" if r["predicted_rel_err"] is None else f"{r['predicted_rel_err']:.3g}"
        what = "bf16" if r["recipe"] == "bf16" else f"{r['backend']} {r['recipe']}"
        table.add_row(r["site"], r["pass"], what, str(r["M_p50"]), str(r["K"]), str(r["N"]),
                      f"{r['predicted_speedup']:.2f}x", err, r["reason"], style=style)  # fmt: skip
    console.print(table)
    if rows.height > limit:
        console.print(f"... {rows.height - limit} more rows (the plan file has them all)")
