"""The report's first screen: what runs in FP8 (per pass), the predicted and measured
speedup, and what was refused and why, grouped (not one row per pass)."""

from __future__ import annotations

import html
import re

import polars as pl

from loka.dispatch.planner import PlanSummary
from loka.schema import PASSES

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(\.\d+)?(e[-+]?\d+)?x?(?!\w)")
_PAREN = re.compile(r"\s*[(\[][^()\[\]]*[)\]]")


def reason_group(reason: str) -> str:
    """A reason without its numbers and parenthesized detail: the reasons of many passes or
    sites that differ only in measurements read as one."""
    text = reason.removeprefix("bf16: ").removeprefix("stays bf16: ")
    while _PAREN.search(text):
        text = _PAREN.sub("", text)
    parts = [p.strip() for p in text.split(":")]
    if len(parts) > 2:  # "measured alone: round 4: ...: not shown to be as fast as bf16"
        parts = [parts[0], parts[-1]]
    text = ": ".join(p for p in parts if p)
    text = _NUMBER.sub("#", text)
    return " ".join(text.replace(" ,", ",").split()).strip(" :;,")


def _sites(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(f"<code>{html.escape(s)}</code>" for s in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def fp8_by_pass(plan: pl.DataFrame) -> str:
    """Per pass: how many sites run it in FP8 and with which recipes; then the sites
    grouped by the set of passes they run in FP8 (34 sites dgrad only, 1 fwd+dgrad)."""
    n_sites = plan["site"].n_unique()
    fp8 = plan.filter(pl.col("recipe") != "bf16")
    rows = []
    for pass_ in PASSES:
        part = fp8.filter(pl.col("pass") == pass_)
        recipes = part.group_by("recipe").len().sort("len", descending=True)
        used = ", ".join(
            f"<code>{html.escape(r)}</code> &times;{n}" for r, n in recipes.iter_rows()
        )
        rows.append(f'<tr><th>{pass_}</th><td class="num">{part.height} of {n_sites}</td>'
                    f"<td>{used or 'bf16 everywhere'}</td></tr>")  # fmt: skip
    combos = (
        fp8.group_by("site", maintain_order=True).agg(pl.col("pass"))
        .with_columns(pl.col("pass").list.join(" + ").alias("passes"))
        .group_by("passes", maintain_order=True).agg(pl.col("site"))
        .sort(pl.col("site").list.len(), descending=True)
    )  # fmt: skip
    items = [
        f"<li><b>{len(s)} site{'s' if len(s) != 1 else ''}</b> run "
        f"{'only ' if ' + ' not in p else ''}<b>{p}</b> in FP8: {_sites(s)}</li>"
        for p, s in combos.iter_rows()
    ]
    n_fp8 = fp8["site"].n_unique()
    return "\n".join([
        f"<p><b>{n_fp8} of {n_sites} sites</b> run at least one pass in FP8.</p>",
        '<table class="compact"><thead><tr><th>pass</th><th>sites in FP8</th><th>recipes</th>'
        "</tr></thead><tbody>", *rows, "</tbody></table>",
        f'<ul class="tight">{"".join(items)}</ul>' if items else "",
    ])  # fmt: skip


def speedup_cards(summary: PlanSummary | None, plan: pl.DataFrame) -> str:
    """Predicted (end to end, or GEMM only when g is unknown) and measured speedup."""
    if summary is None:
        return ""
    est = " (ESTIMATED)" if summary.estimated else ""
    if summary.predicted_speedup is not None:
        predicted = f"{summary.predicted_speedup:.3f}x"
        detail = (f"end to end{est}; GEMMs {summary.gemm_speedup:.2f}x, ceiling "
                  f"{summary.ceiling:.3f}x with g = {summary.gemm_share:.2f}")  # fmt: skip
        safe = summary.safe_ceiling
        if safe is not None and safe < summary.ceiling - 5e-4:
            detail += f" ({safe:.3f}x over the candidates accurate enough)"
        if summary.unconstrained_speedup is not None:
            detail += (f"; {summary.unconstrained_speedup:.3f}x with every FP8 candidate "
                       "allowed, quantizations included")  # fmt: skip
    else:
        predicted = f"{summary.gemm_speedup:.2f}x"
        detail = f"GEMM time of the planned sites{est}; end to end unknown (no measured g)"
    if summary.measured_speedup is None:
        measured, mdetail = "not measured", "verification runs on a GPU, on the real step"
    elif summary.measured_interval is None:
        measured = "1.000x"
        mdetail = (f"no FP8 site kept: verification demoted all {len(summary.verify_demoted)}, "
                   f"the step runs bf16 ({summary.measured_steps} steps)")  # fmt: skip
    else:
        low, high = summary.measured_interval
        kept = len(summary.verified_sites or [])
        measured = f"{summary.measured_speedup:.3f}x"
        mdetail = (f"[{low:.3f}, {high:.3f}] ({summary.measured_confidence:.0%} interval), "
                   f"{kept} of {kept + len(summary.verify_demoted)} FP8 sites kept, "
                   f"{summary.measured_steps} steps, {summary.measured_method}")  # fmt: skip
    cards = [("predicted", predicted, detail), ("measured", measured, mdetail)]
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{k}</div><div class="big">{html.escape(v)}</div>'
        f'<div class="detail">{html.escape(d)}</div></div>'
        for k, v, d in cards
    ) + "</div>"  # fmt: skip


def refusals(plan: pl.DataFrame, summary: PlanSummary | None) -> str:
    """Passes kept in bf16 grouped by reason (with the passes and sites they cover and the
    commonest reasons their FP8 candidates lost), then verification's demotions grouped."""
    kept = plan.filter(pl.col("recipe") == "bf16")
    groups: dict[str, dict] = {}
    for r in kept.iter_rows(named=True):
        g = groups.setdefault(reason_group(r["reason"]),
                              {"passes": dict.fromkeys(PASSES, 0), "sites": [], "why": {}})  # fmt: skip
        g["passes"][r["pass"]] += 1
        if r["site"] not in g["sites"]:
            g["sites"].append(r["site"])
        for x in r["rejected"] or []:
            if x["recipe"] != "bf16":
                key = reason_group(x["reason"]).split(":")[0]
                g["why"][key] = g["why"].get(key, 0) + 1
    rows = []
    for reason, g in sorted(groups.items(), key=lambda kv: -sum(kv[1]["passes"].values())):
        n = sum(g["passes"].values())
        per_pass = ", ".join(f"{p} {k}" for p, k in g["passes"].items() if k)
        why = sorted(g["why"].items(), key=lambda kv: -kv[1])[:3]
        why_text = "; ".join(f"{html.escape(w)} ({k})" for w, k in why)
        rows.append(
            f'<tr><td class="num">{n}</td><td>{per_pass}</td><td><b>{html.escape(reason)}</b>'
            + (f'<div class="detail">candidates: {why_text}</div>' if why_text else "")
            + f"</td><td>{len(g['sites'])}: {_sites(g['sites'], 3)}</td></tr>"
        )
    out = []
    if rows:
        out += [
            f"<p><b>{kept.height} passes stay bf16</b>, for {len(groups)} reason(s):</p>",
            '<table class="compact"><thead><tr><th>passes</th><th>by pass</th><th>why</th>'
            "<th>sites</th></tr></thead><tbody>", *rows, "</tbody></table>",
        ]  # fmt: skip
    demoted = summary.verify_demoted if summary is not None else {}
    if demoted:
        by: dict[str, list[str]] = {}
        for site, why in demoted.items():
            by.setdefault(reason_group(why), []).append(site)
        items = "".join(
            f"<li><b>{len(s)}</b>: {html.escape(w)}: {_sites(s, 3)}</li>"
            for w, s in sorted(by.items(), key=lambda kv: -len(kv[1]))
        )
        out.append(f"<p><b>{len(demoted)} FP8 sites demoted by verification</b> on the real "
                   f'step:</p><ul class="tight">{items}</ul>')  # fmt: skip
    return "\n".join(out) or "<p>Nothing refused: every pass runs in FP8.</p>"


def glance(plan: pl.DataFrame, summary: PlanSummary | None) -> str:
    return "\n".join([
        '<section id="glance">',
        speedup_cards(summary, plan),
        '<div class="columns"><div><h2>What runs in FP8</h2>', fp8_by_pass(plan), "</div>",
        '<div><h2 id="refused">What stays bf16, and why</h2>', refusals(plan, summary),
        "</div></div>", "</section>",
    ])  # fmt: skip
