"""The report's figures, each a matplotlib `Figure` rendered to inline SVG (no files, no
fonts or images fetched: text is drawn as paths)."""

from __future__ import annotations

import io
import math
import re

import polars as pl
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

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


# Error ratios and speedups beyond these are drawn at the edge: one extreme value must not
# stretch an axis over decades where nothing else is.
RATIO_RANGE = (1e-3, 1e3)
SPEED_RANGE = (0.125, 8.0)


def _clip(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def _legend_above(fig: Figure, handles: list, ncols: int) -> None:
    """The legend above the plots, never over a point."""
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=ncols,
               fontsize=9, frameon=False)  # fmt: skip


def _verdict_handles() -> list:
    from matplotlib.lines import Line2D

    return [Line2D([], [], marker="o", ls="", color=c, label=v) for v, c in VERDICT_COLORS.items()]


def error_vs_budget(site_errors: pl.DataFrame) -> Figure:
    """Per pass (side by side), every site's error bound for each recipe over its budget
    (colour: verdict); sites on the y axis, so every label is readable."""
    from matplotlib.lines import Line2D

    sites = site_errors["site"].unique(maintain_order=True).to_list()
    index = {s: len(sites) - 1 - i for i, s in enumerate(sites)}  # first site on top
    fig = Figure(figsize=(11, 0.19 * len(sites) + 1.2))
    axes = fig.subplots(1, len(PASSES), sharey=True)
    rows = site_errors.with_columns(_bound(site_errors).alias("b")).filter(
        pl.col("b").is_not_null() & (pl.col("budget") > 0)
    )
    for ax, pass_ in zip(axes, PASSES, strict=True):
        part = rows.filter(pl.col("pass") == pass_)
        for verdict, color in VERDICT_COLORS.items():
            v = part.filter(pl.col("verdict") == verdict)
            if v.height:
                ratios = [
                    _clip(b / g, RATIO_RANGE) for b, g in zip(v["b"], v["budget"], strict=True)
                ]
                ax.scatter(ratios, [index[s] for s in v["site"]], s=14, color=color, alpha=0.8)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(RATIO_RANGE[0] / 1.5, RATIO_RANGE[1] * 1.5)
        ax.set_xlabel(f"{pass_}: error bound / budget")
        ax.grid(alpha=0.3)
    axes[0].set_yticks(range(len(sites)))
    axes[0].set_yticklabels(sites[::-1], fontsize=8)
    axes[0].set_ylim(-0.7, len(sites) - 0.3)
    budget = Line2D([], [], color="black", lw=1, label="budget (left of it: within)")
    _legend_above(fig, [*_verdict_handles(), budget], ncols=4)
    fig.tight_layout()
    return fig


def safety_speed_map(
    plan: pl.DataFrame, site_errors: pl.DataFrame, bench: pl.DataFrame | None
) -> Figure:
    """Every (site, pass, recipe) with a timing: speed relative to bf16 (x) against error
    relative to budget (y). Bottom right is safe and fast; the chosen ones are ringed."""
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(8, 6))
    ax = fig.add_subplot(1, 1, 1)
    points = _candidate_points(plan, site_errors, bench)
    for p in points:
        p["speedup"] = _clip(p["speedup"], SPEED_RANGE)
        p["err_ratio"] = _clip(p["err_ratio"], RATIO_RANGE)
    for pass_, marker in PASS_MARKERS.items():
        part = [p for p in points if p["pass"] == pass_]
        if part:
            ax.scatter([p["speedup"] for p in part], [p["err_ratio"] for p in part], marker=marker,
                       s=22, c=[VERDICT_COLORS[p["verdict"]] for p in part], alpha=0.75)  # fmt: skip
    chosen = [p for p in points if p["chosen"]]
    if chosen:
        ax.scatter([p["speedup"] for p in chosen], [p["err_ratio"] for p in chosen], s=90,
                   facecolors="none", edgecolors="black")  # fmt: skip
    ax.axvline(1.0, color="grey", lw=1)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(SPEED_RANGE[0] / 1.2, SPEED_RANGE[1] * 1.2)
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short log axis
    ax.set_ylim(RATIO_RANGE[0] / 1.5, RATIO_RANGE[1] * 1.5)
    ax.set_xlabel("speed vs bf16 at the site's shape (>1: faster)")
    ax.set_ylabel("error bound / budget (<1: within budget)")
    for x, y, text in ((0.98, 0.02, "safe, fast"), (0.02, 0.02, "safe, slow"),
                       (0.98, 0.96, "unsafe, fast"), (0.02, 0.96, "unsafe, slow")):  # fmt: skip
        ax.text(x, y, text, transform=ax.transAxes, ha="right" if x > 0.5 else "left",
                va="bottom" if y < 0.5 else "top", fontsize=9, color="dimgrey")  # fmt: skip
    passes = [
        Line2D([], [], marker=m, ls="", color="grey", label=p) for p, m in PASS_MARKERS.items()
    ]
    ring = Line2D([], [], marker="o", ls="", markersize=9, markerfacecolor="none",
                  markeredgecolor="black", label="chosen")  # fmt: skip
    _legend_above(fig, [*_verdict_handles(), *passes, ring], ncols=7)
    ax.grid(alpha=0.3, which="both")
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
    _legend_above(fig, ax.get_legend_handles_labels()[0], ncols=3)
    ax.grid(alpha=0.3, which="both")
    return fig


def time_share(sites: pl.DataFrame, plan: pl.DataFrame, top: int = 30) -> tuple[Figure, str]:
    """Per site, its bf16 GEMM time (all passes) beside its planned time, largest first:
    where the time goes and what the plan saves there. The measured share of step time
    (`sites.time_share`, CUDA only) is written beside the bars when known."""
    per_site = plan.group_by("site", maintain_order=True).agg(
        pl.col("bf16_ms").fill_nan(None).sum().alias("bf16"),
        pl.col("predicted_ms").fill_nan(None).sum().alias("planned"),
    )
    merged = per_site.join(sites.select("site", "time_share"), on="site", how="left")
    measured = merged.height > 0 and merged["time_share"].null_count() == 0
    merged = merged.sort("bf16", descending=True, nulls_last=True).head(top)
    label = "GEMM time per site (all passes), bf16 and as planned"
    if measured:
        label += "; beside the bars: the site's measured share of step time"
    fig = Figure(figsize=(10, 0.26 * merged.height + 1.4))
    ax = fig.add_subplot(1, 1, 1)
    ys = list(range(merged.height))[::-1]
    ax.barh([y + 0.2 for y in ys], merged["bf16"].fill_null(0), height=0.4, color="#bbbbbb",
            label="bf16")  # fmt: skip
    ax.barh([y - 0.2 for y in ys], merged["planned"].fill_null(0), height=0.4, color="#2a9d8f",
            label="planned")  # fmt: skip
    for y, b, p, share in zip(ys, merged["bf16"], merged["planned"], merged["time_share"],
                              strict=True):  # fmt: skip
        text = f"  {b / p:.2f}x" if b and p and p < b else ""
        if measured and share is not None:
            text += f"  ({share:.1%} of step)"
        if text and b:
            ax.text(b, y, text, va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels(merged["site"], fontsize=8)
    ax.set_xlabel("GEMM time, ms (bf16: grey; planned: green)")
    ax.margins(x=0.18)
    _legend_above(fig, ax.get_legend_handles_labels()[0], ncols=2)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig, label
