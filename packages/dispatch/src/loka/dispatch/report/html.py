"""`write_report`: one self-contained HTML page (inline CSS and SVG, nothing fetched) with
the plan, what it predicts and the plots behind it."""

from __future__ import annotations

import datetime as dt
import html
import os
import tempfile
from importlib import resources
from pathlib import Path
from string import Template

import polars as pl

from loka.dispatch.planner import PlanSummary
from loka.dispatch.report import plots
from loka.dispatch.report.glance import glance

FIGURES = ("error-vs-budget", "safety-speed-map", "speedup-vs-shape", "time-share")


def _figure(fig_id: str, svg: str, caption: str, heading: str) -> str:
    return (
        f"<h3>{html.escape(heading)}</h3>\n"
        f'<figure id="{fig_id}">\n{svg}\n<figcaption>{html.escape(caption)}</figcaption>\n</figure>'
    )


def _plan_table(plan: pl.DataFrame) -> str:
    head = ("site", "pass", "backend", "recipe", "M", "K", "N", "bf16 ms", "planned ms",
            "speedup", "error bound", "budget", "estimated", "reason", "rejected")  # fmt: skip
    out = [
        "<table>",
        "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>",
        "<tbody>",
    ]
    for r in plan.iter_rows(named=True):

        def num(v, fmt="{:.4g}"):
            return "" if v is None else fmt.format(v)

        rejected = "".join(
            f"<li><code>{html.escape(x['backend'])} {html.escape(x['recipe'])}</code>: "
            f"{html.escape(x['reason'])}</li>"
            for x in r["rejected"]
        )
        cells = [
            html.escape(r["site"]), r["pass"], html.escape(r["backend"]),
            f"<code>{html.escape(r['recipe'])}</code>",
            f'<td class="num">{r["M_p50"]}', f'<td class="num">{r["K"]}', f'<td class="num">{r["N"]}',
            f'<td class="num">{num(r["bf16_ms"])}', f'<td class="num">{num(r["predicted_ms"])}',
            f'<td class="num">{num(r["predicted_speedup"], "{:.2f}x")}',
            f'<td class="num">{num(r["predicted_rel_err"])}', f'<td class="num">{num(r["budget"])}',
            "yes" if r["estimated"] else "no", f'<td class="reason">{html.escape(r["reason"])}',
            f"<details><summary>{len(r['rejected'])}</summary><ul>{rejected}</ul></details>"
            if r["rejected"] else "0",
        ]  # fmt: skip
        row_class = ' class="fp8"' if r["recipe"] != "bf16" else ""
        tds = "".join(c if c.startswith("<td") else f"<td>{c}" for c in cells)
        out.append(f"<tr{row_class}>{tds}</tr>")
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


def _verify_table(summary: PlanSummary | None) -> str:
    """The rounds of verification on the real step (`loka.dispatch.verify`), if it ran."""
    if summary is None or not summary.verify_rounds:
        return ""
    head = ("round", "FP8 sites", "measured", "interval", "predicted", "verdict", "steps")
    rows = []
    for r in summary.verify_rounds:
        predicted = "" if r["predicted"] is None else f"{r['predicted']:.3f}x"
        cells = (
            f'<td class="num">{r["round"]}', f'<td class="num">{r["sites"]}',
            f'<td class="num">{r["speedup"]:.3f}x', f'<td class="num">[{r["low"]:.3f}, {r["high"]:.3f}]',
            f'<td class="num">{predicted}', f"<td>{html.escape(r['verdict'])}",
            f'<td class="num">{r["steps"]}',
        )  # fmt: skip
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join([
        '<h2 id="verification">Verified on the real training step</h2>',
        '<p class="meta">Each round times one set of FP8 sites against bf16 in alternating '
        "blocks of training steps (speedup over bf16, with its interval); sites are demoted "
        "until the planned step is not slower than bf16 with confidence.</p>",
        "<table>",
        "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>",
        "<tbody>", *rows, "</tbody>", "</table>",
    ])  # fmt: skip


def render_report(
    *,
    sites: pl.DataFrame,
    site_errors: pl.DataFrame,
    plan: pl.DataFrame,
    kernel_bench: pl.DataFrame | None = None,
    summary: PlanSummary | None = None,
    title: str = "LoKA plan report",
) -> str:
    """The report page as a string."""
    figures = []
    fig = plots.error_vs_budget(site_errors)
    figures.append(_figure(FIGURES[0], plots.to_svg(fig),
                           "Each dot is one recipe's upper confidence bound of the GEMM's relative "
                           "error on sampled real batches (Probe) over the site's budget: left of "
                           "the black line is within budget. Ratios beyond 1e-3..1e3 are drawn at "
                           "the edge.", "Error of each recipe against its budget, per site"))  # fmt: skip
    fig = plots.safety_speed_map(plan, site_errors, kernel_bench)
    figures.append(_figure(FIGURES[1], plots.to_svg(fig),
                           "Every probed recipe with a timing, at its best backend: right of 1 is "
                           "faster than bf16, below 1 within budget. Ringed: chosen. Values "
                           "beyond the axes are drawn at the edge.",
                           "Safe or unsafe, fast or slow: every timed candidate"))  # fmt: skip
    fig = plots.speedup_vs_shape(plan)
    figures.append(_figure(FIGURES[2], plots.to_svg(fig),
                           "The planned speedup of each pass (quantization included) against the "
                           "size of its GEMM; small GEMMs rarely gain from FP8.",
                           "Speedup against GEMM size"))  # fmt: skip
    fig, label = plots.time_share(sites, plan)
    figures.append(_figure(FIGURES[3], plots.to_svg(fig), f"Bars: {label}; label: the planned "
                           "site speedup.", "Where the GEMM time goes, and what the plan saves"))  # fmt: skip
    estimated = bool(plan["estimated"].any()) if plan.height else False
    device = summary.device if summary is not None else "unknown"
    banner = ""
    if estimated:
        banner = (
            '<p class="estimate">ESTIMATED: kernel times come from a recorded table of '
            f"{html.escape(device)} (cost model), not from measurements on this machine.</p>"
        )
    lines = summary.lines() if summary is not None else [f"{plan['site'].n_unique()} sites planned"]
    template = Template((resources.files("loka.dispatch.report") / "template.html").read_text())
    generated = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return template.substitute(
        title=html.escape(title),
        meta=html.escape(f"generated {generated}; device {device}; {sites.height} sites"),
        estimate_banner=banner,
        summary="\n".join(f"<li>{html.escape(line)}</li>" for line in lines),
        glance=glance(plan, summary),
        figures="\n".join([_verify_table(summary), *figures]),
        plan_rows=str(plan.height),
        plan_table=_plan_table(plan),
    )


def write_report(path: str | os.PathLike[str], **tables) -> Path:
    """Render the report (`render_report`'s arguments) and write it to `path` atomically."""
    path = Path(path)
    text = render_report(**tables)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
