"""The report's figures, each a matplotlib `Figure` rendered to inline SVG (no files, no
fonts or images fetched: text is drawn as paths)."""

from __future__ import annotations

import io
import math
import re

import polars as pl
from matplotlib.figure import Figure

from loka.dispatch.bench.candidates import m_bucket, speed_key
from loka.schema import PASSES

VERDICT_COLORS = {"safe": "#2a9d8f", "undecided": "#e9c46a", "unsafe": "#e76f51"}
PASS_MARKERS = {"fwd": "o", "dgrad": "s", "wgrad": "^"}
_STRIP = (
    re.compile(r"<\?xml[^>]*\?>\s*"),
    re.compile(r"<!DOCTYPE[^>]*>\s*"),
    re.compile(r"<metadata>.*?</metadata>\s*", re.S),
)


def to_svg(fig: Figure) -> str:
    """The figure as an <svg> element, without the XML prolog, DOCTYPE and RDF metadata
    (which name external URLs)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    for pattern in _STRIP:
        text = pattern.sub("", text)
    return text


def _bound(df: pl.DataFrame) -> pl.Expr:
    return pl.coalesce("ucb_rel_err", "mean_rel_err")


def error_vs_budget(site_errors: pl.DataFrame) -> Figure:
    """Per pass, every site's error bound for each recipe (colour: verdict) against its
    budget (black ticks)."""
    fig = Figure(figsize=(11, 3.6 * len(PASSES)))
    sites = site_errors["site"].unique(maintain_order=True).to_list()
    index = {s: i for i, s in enumerate(sites)}
    for k, pass_ in enumerate(PASSES):
        ax = fig.add_subplot(len(PASSES), 1, k + 1)
        rows = site_errors.filter(pl.col("pass") == pass_).with_columns(
            _bound(site_errors).alias("b")
        )
        for verdict, color in VERDICT_COLORS.items():
            part = rows.filter(pl.col("verdict") == verdict)
            if part.height:
                ax.scatter([index[s] for s in part["site"]], part["b"], s=14, color=color,
                           label=verdict, alpha=0.8)  # fmt: skip
        budgets = rows.group_by("site", maintain_order=True).agg(pl.col("budget").first())
        ax.scatter([index[s] for s in budgets["site"]], budgets["budget"], marker="_", s=120,
                   color="black", label="budget")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylabel(f"{pass_}: relative error (UCB)")
        ax.set_xticks(range(len(sites)))
        ax.set_xticklabels(
            sites if len(sites) <= 60 else [""] * len(sites), rotation=90, fontsize=6
        )
        ax.legend(loc="upper right", fontsize=7, ncols=4)
        ax.grid(alpha=0.3)
    fig.suptitle("Per-site error of each recipe against its budget")
    return fig


def safety_speed_map(
    plan: pl.DataFrame, site_errors: pl.DataFrame, bench: pl.DataFrame | None
) -> Figure:
    """Every (site, pass, recipe) with a timing: speed relative to bf16 (x) against error
    relative to budget (y). Bottom right is safe and fast; the chosen ones are ringed."""
    fig = Figure(figsize=(8, 6))
    ax = fig.add_subplot(1, 1, 1)
    points = _candidate_points(plan, site_errors, bench)
    for pass_, marker in PASS_MARKERS.items():
        part = [p for p in points if p["pass"] == pass_]
        if part:
            ax.scatter([p["speedup"] for p in part], [p["err_ratio"] for p in part], marker=marker,
                       s=22, c=[VERDICT_COLORS[p["verdict"]] for p in part], alpha=0.75,
                       label=pass_)  # fmt: skip
    chosen = [p for p in points if p["chosen"]]
    if chosen:
        ax.scatter([p["speedup"] for p in chosen], [p["err_ratio"] for p in chosen], s=90,
                   facecolors="none", edgecolors="black", label="chosen")  # fmt: skip
    ax.axvline(1.0, color="grey", lw=1)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("speed vs bf16 at the site's shape (>1: faster)")
    ax.set_ylabel("error bound / budget (<1: within budget)")
    for x, y, text in ((0.98, 0.02, "safe, fast"), (0.02, 0.02, "safe, slow"),
                       (0.98, 0.96, "unsafe, fast"), (0.02, 0.96, "unsafe, slow")):  # fmt: skip
        ax.text(x, y, text, transform=ax.transAxes, ha="right" if x > 0.5 else "left",
                va="bottom" if y < 0.5 else "top", fontsize=9, color="dimgrey")  # fmt: skip
    ax.legend(fontsize=8, loc="center left")
    ax.grid(alpha=0.3, which="both")
    ax.set_title("Safe/unsafe x fast/slow: every timed candidate (colour: verdict)")
    return fig


def _candidate_points(plan, site_errors, bench) -> list[dict]:
    """(site, pass, recipe): best speedup over the timed backends, error ratio, verdict."""
    if bench is None or bench.is_empty():
        return []
    timed: dict[tuple, float] = {}
    bf16: dict[tuple, float] = {}
    for r in bench.iter_rows(named=True):
        key = (r["M_bucket"], r["K"], r["N"], r["pass"])
        if r["recipe"] == "bf16":
            bf16[key] = r["median_ms"]
        else:
            k2 = (*key, speed_key(r["recipe"]))
            timed[k2] = min(timed.get(k2, math.inf), r["median_ms"])
    shapes = {
        r["site"]: (m_bucket(max(r["M_p50"], 1)), r["K"], r["N"])
        for r in plan.iter_rows(named=True)
    }
    chosen = {(r["site"], r["pass"], r["recipe"]) for r in plan.iter_rows(named=True)}
    points = []
    for r in site_errors.iter_rows(named=True):
        shape = shapes.get(r["site"])
        if shape is None:
            continue
        key = (*shape, r["pass"])
        t = timed.get((*key, speed_key(r["recipe"])))
        if t is None or key not in bf16 or not r["budget"]:
            continue
        bound = r["ucb_rel_err"] if r["ucb_rel_err"] is not None else r["mean_rel_err"]
        points.append(
            {"pass": r["pass"], "speedup": bf16[key] / t, "err_ratio": max(bound / r["budget"], 1e-3),
             "verdict": r["verdict"], "chosen": (r["site"], r["pass"], r["recipe"]) in chosen}
        )  # fmt: skip
    return points


def speedup_vs_shape(plan: pl.DataFrame) -> Figure:
    """Planned speedup of each site and pass against the GEMM's size (flops)."""
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot(1, 1, 1)
    rows = plan.filter(pl.col("bf16_ms").is_not_nan())
    for pass_, marker in PASS_MARKERS.items():
        part = rows.filter(pl.col("pass") == pass_)
        if part.height:
            flops = [
                2.0 * max(m, 1) * k * n
                for m, k, n in zip(part["M_p50"], part["K"], part["N"], strict=True)
            ]
            colors = ["#264653" if r != "bf16" else "#bbbbbb" for r in part["recipe"]]
            ax.scatter(flops, part["predicted_speedup"], marker=marker, c=colors, s=28, label=pass_)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("GEMM size (flops of the pass, 2 M K N)")
    ax.set_ylabel("planned speedup vs bf16 (grey: stays bf16)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.set_title("Speedup against shape")
    return fig


def time_share(sites: pl.DataFrame, plan: pl.DataFrame, top: int = 30) -> tuple[Figure, str]:
    """Where step time goes per site (measured `time_share`), or, without it, each site's
    share of the bf16 GEMM time at its shape; with the planned site speedup."""
    per_site = plan.group_by("site", maintain_order=True).agg(
        pl.col("bf16_ms").sum().alias("bf16"), pl.col("predicted_ms").sum().alias("planned")
    )
    merged = per_site.join(sites.select("site", "time_share"), on="site", how="left")
    measured = merged["time_share"].null_count() == 0 and merged.height > 0
    if measured:
        merged = merged.with_columns(pl.col("time_share").alias("share"))
        label = "share of measured step time (sites.time_share)"
    else:
        total = merged["bf16"].fill_nan(0).sum() or 1.0
        merged = merged.with_columns((pl.col("bf16").fill_nan(0) / total).alias("share"))
        label = "share of the sites' bf16 GEMM time (no measured step-time share)"
    merged = merged.sort("share", descending=True).head(top)
    fig = Figure(figsize=(9, 0.28 * merged.height + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(merged.height))[::-1]
    ax.barh(ys, merged["share"], color="#8ab17d")
    for y, share, b, p in zip(ys, merged["share"], merged["bf16"], merged["planned"], strict=True):
        if p and b and not math.isnan(b) and p < b:
            ax.text(share, y, f"  {b / p:.2f}x", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels(merged["site"], fontsize=7)
    ax.set_xlabel(label)
    ax.set_title(f"Time share of the top {merged.height} sites (label: planned site speedup)")
    ax.grid(alpha=0.3, axis="x")
    return fig, label
