"""`Probe.summary()`: one line per site with its verdicts, as a rich table."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import polars as pl

from loka.schema import PASSES

if TYPE_CHECKING:
    from rich.console import Console

_MARK = {"safe": "[green]safe[/]", "unsafe": "[red]unsafe[/]", "undecided": "[yellow]?[/]"}


def _pass_cell(errors: pl.DataFrame) -> str:
    """Counts of safe/unsafe/undecided recipes and the safe one with the lowest bound."""
    if errors.is_empty():
        return "-"
    counts = {v: int((errors["verdict"] == v).sum()) for v in ("safe", "unsafe", "undecided")}
    text = f"{counts['safe']}/{counts['unsafe']}/{counts['undecided']}"
    safe = errors.filter(pl.col("verdict") == "safe").sort("ucb_rel_err")
    if len(safe):
        text += f" {safe['recipe'][0]} ({safe['ucb_rel_err'][0]:.3f})"
    return text


def render_summary(
    tables: Mapping[str, pl.DataFrame], counters: Mapping[str, Any], console: Console | None
) -> str:
    # rich is imported here: training (and the GPU benchmark) runs without it.
    from rich.console import Console
    from rich.table import Table

    sites, errors = tables["sites"], tables["site_errors"]
    table = Table(
        title="loka.probe: FP8 verdicts per site (safe/unsafe/undecided, best safe recipe (UCB))",
        show_lines=False,
    )
    for name in ("site", "K x N", "M p50", "time", *PASSES, "drift"):
        table.add_column(name, overflow="fold")
    for row in sites.iter_rows(named=True):
        mine = errors.filter(pl.col("site") == row["site"])
        share = row["time_share"]
        table.add_row(
            row["site"],
            f"{row['K']} x {row['N']}" + (f" ({row['groups']} GEMMs)" if row["groups"] > 1 else ""),
            str(row["M_p50"]),
            "-" if share is None else f"{100 * share:.1f}%",
            *(_pass_cell(mine.filter(pl.col("pass") == p)) for p in PASSES),
            "" if row["drift_step"] is None else f"step {row['drift_step']}: {row['drift_reason']}",
        )
    verdicts = {v: int((errors["verdict"] == v).sum()) for v in ("safe", "unsafe", "undecided")}
    caption = (
        f"step {counters['step']}, {counters['sampled_steps']} sampled steps, "
        f"{counters['dropped_steps']} dropped (queue full), "
        f"{int(sites['nonfinite_batches'].sum()) if len(sites) else 0} batches with NaN/Inf, "
        f"{counters['errors']} capture/analysis errors; verdicts: {verdicts['safe']} safe, "
        f"{verdicts['unsafe']} unsafe, {verdicts['undecided']} undecided"
    )
    table.caption = caption
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: room for recipe names
            console = Console(width=max(console.width, 160))
    buffer = io.StringIO()
    Console(file=buffer, width=console.width, no_color=True).print(table)
    console.print(table)
    return buffer.getvalue()
