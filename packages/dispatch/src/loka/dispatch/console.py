"""Terminal output of the `loka` commands: rich progress bars, the plan at a glance (one
line per site, 80 columns) and the plan as a full table (`--verbose`)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loka.schema import PASSES

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


# The compact plan fits a terminal of this many columns: one line per site.
WIDTH = 80
_SITE_MAX = 32


def _fit(text: str, width: int) -> str:
    """`text` in at most `width` columns. A dotted site name loses letters from its longest
    parts first (`~` marks a cut), so the numbers that tell sites apart (a block's index)
    stay; what is still too long loses its middle."""
    if len(text) <= width:
        return text
    parts = text.split(".")
    while len(".".join(parts)) > width:
        i = max(range(len(parts)), key=lambda k: len(parts[k]))
        if len(parts[i]) <= 3:
            break
        parts[i] = parts[i].rstrip("~")[:-1] + "~"
    text = ".".join(parts)
    if len(text) <= width:
        return text
    if width < 5:
        return text[:width]
    head = (width - 1) // 2
    return text[:head] + "~" + text[len(text) - (width - 1 - head) :]


def site_rows(plan: pl.DataFrame) -> list[dict]:
    """Per site, in plan order: the passes in FP8, their recipes, and the site's planned
    speedup over bf16 (all its passes' bf16 time over all its planned time)."""
    out: dict[str, dict] = {}
    for r in plan.iter_rows(named=True):
        site = out.setdefault(r["site"], {"site": r["site"], "passes": [], "recipes": [],
                                          "bf16": 0.0, "planned": 0.0})  # fmt: skip
        if r["recipe"] != "bf16":
            site["passes"].append(r["pass"])
            site["recipes"].append(r["recipe"])
        b, p = r["bf16_ms"], r["predicted_ms"]
        if b is not None and p is not None and b == b and p == p:  # NaN: no bf16 timing
            site["bf16"] += b
            site["planned"] += p
    for site in out.values():
        site["speedup"] = site["bf16"] / site["planned"] if site["planned"] > 0 else None
    return list(out.values())


def plan_lines(plan: pl.DataFrame, *, show_bf16: bool = False, width: int = WIDTH) -> list[str]:
    """The plan at a glance, every line at most `width` columns: what runs in FP8 per pass,
    one line per FP8 site (site, passes in FP8, recipe, planned site speedup), and the
    passes kept in bf16 grouped by reason. The full table: `print_plan`."""
    sites = site_rows(plan)
    fp8 = [s for s in sites if s["passes"]]
    lines = [f"plan: {len(sites)} sites, {len(fp8)} with a pass in FP8"]
    if fp8:
        per_pass = {p: sum(p in s["passes"] for s in fp8) for p in PASSES}
        lines.append("FP8 sites per pass: " + ", ".join(f"{p} {n}" for p, n in per_pass.items()))
        combos: dict[str, int] = {}
        for s in fp8:
            combos["+".join(s["passes"])] = combos.get("+".join(s["passes"]), 0) + 1
        lines += _wrapped("in FP8: " + "; ".join(f"{n} site(s) {c}" for c, n in combos.items()),
                          width)  # fmt: skip
    shown = sites if show_bf16 else fp8
    if shown:
        lines += _site_table(shown, width)
    kept = plan.filter(pl.col("recipe") == "bf16")
    if kept.height:
        lines.append(f"kept in bf16: {kept.height} passes, by reason:")
        groups = kept.group_by("reason", maintain_order=True).agg(pl.len().alias("n"))
        for reason, n in groups.sort("n", descending=True, maintain_order=True).iter_rows():
            lines += _wrapped(f"{n:>5}  {reason.removeprefix('bf16: ')}", width, indent=7)
    return lines


def _site_table(sites: list[dict], width: int) -> list[str]:
    site_w = max(4, min(_SITE_MAX, max(len(s["site"]) for s in sites)))
    pass_w = max(len("passes"), max(len("+".join(s["passes"]) or "-") for s in sites))
    speed_w = len("speedup")
    room = width - (site_w + pass_w + speed_w + 6)

    def full(s: dict) -> str:
        if not s["passes"]:
            return "bf16"
        if len(set(s["recipes"])) == 1:
            return s["recipes"][0]
        return ", ".join(f"{p} {r}" for p, r in zip(s["passes"], s["recipes"], strict=True))

    legend: dict[str, str] = {}
    if any(len(full(s)) > room for s in sites):  # name long recipes by a key, listed below
        for s in sites:
            if len(full(s)) > room:
                for r in s["recipes"]:
                    legend.setdefault(r, f"R{len(legend) + 1}")

    def cell(s: dict) -> str:
        text = full(s)
        if len(text) > room and s["passes"]:
            keys = [legend[r] for r in s["recipes"]]
            text = keys[0] if len(set(keys)) == 1 else ", ".join(
                f"{p} {k}" for p, k in zip(s["passes"], keys, strict=True))  # fmt: skip
        return _fit(text, room)

    head = f"{'site':<{site_w}}  {'passes':<{pass_w}}  {'speedup':>{speed_w}}  recipe"
    out = [head[:width]]
    for s in sites:
        speed = "" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        line = (f"{_fit(s['site'], site_w):<{site_w}}  {'+'.join(s['passes']) or '-':<{pass_w}}  "
                f"{speed:>{speed_w}}  {cell(s)}")  # fmt: skip
        out.append(line.rstrip())
    for recipe, key in legend.items():
        out += _wrapped(f"  {key} = {recipe}", width, indent=len(key) + 5)
    return out


def _wrapped(text: str, width: int, indent: int = 4) -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=True) or [""]  # fmt: skip


def wrap_lines(lines: list[str], width: int = WIDTH, prefix: str = "") -> list[str]:
    """Lines (a plan summary's) wrapped to `width` columns, continuations indented."""
    out = []
    for line in lines:
        out += _wrapped(prefix + line, width, indent=len(prefix) + 4)
    return out


def print_lines(lines: list[str]) -> None:
    """Print lines as they are: no rich markup read in them, no wrapping added."""
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)
