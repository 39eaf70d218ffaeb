"""The plan at a glance: the console's compact summary (80 columns, one line per site) and
the report's first screen (what runs in FP8 per pass, predicted and measured speedup, what
was refused and why, grouped). Built from a synthetic plan: no probing, fast."""

from __future__ import annotations

import re

import polars as pl
import pytest

from loka.dispatch.console import WIDTH, plan_lines, print_lines, wrap_lines
from loka.dispatch.planner import PlanSummary

RECIPES = ("e4m3:e4m3/row/dynamic", "e5m2:e4m3/tensor/dynamic", "e4m3:e4m3/row/dynamic/pow2")


def many_site_plan(n_sites: int = 40) -> pl.DataFrame:
    """A plan of `n_sites` sites with long names: most run only dgrad in FP8, a few fwd and
    dgrad with different recipes, a few stay bf16 (unsafe, or no faster)."""
    rows = []
    for i in range(n_sites):
        site = f"encoder.layers.{i}.interaction_block.cross_attention.output_projection"
        for j, pass_ in enumerate(("fwd", "dgrad", "wgrad")):
            fp8 = (pass_ == "dgrad" and i % 7 != 6) or (pass_ == "fwd" and i % 5 == 0)
            recipe = RECIPES[(i + j) % 3] if fp8 else "bf16"
            if fp8:
                reason = f"fastest safe choice: 1.{i:02d}x bf16, error bound 0.01 <= budget 0.05"
            elif i % 2:
                reason = "bf16: no FP8 candidate is safe (and allowed) here"
            else:
                reason = "bf16: no safe FP8 candidate is faster than bf16 here"
            rejected = [] if fp8 else [
                {"backend": "torch.scaled_mm", "recipe": RECIPES[0],
                 "reason": f"unsafe: error bound {0.1 + i / 100:.4g} > budget 0.05"},
                {"backend": "triton.fp8", "recipe": RECIPES[1],
                 "reason": f"slower than bf16: {1 + i / 10:.4g} ms vs 1 ms (also with "
                 "quantizations shared)"},
            ]  # fmt: skip
            rows.append({
                "site": site, "pass": pass_, "backend": "torch.scaled_mm" if fp8 else "torch.bf16",
                "recipe": recipe, "K": 1024, "N": 4096, "M_p50": 8192, "bf16_ms": 1.0,
                "predicted_ms": 0.8 if fp8 else 1.0, "predicted_speedup": 1.25 if fp8 else 1.0,
                "predicted_rel_err": 0.01 if fp8 else None, "budget": 0.05 if fp8 else None,
                "estimated": False, "reason": reason, "rejected": rejected, "fuse_norm": False,
            })  # fmt: skip
    return pl.DataFrame(rows)


def verified_summary(plan: pl.DataFrame) -> PlanSummary:
    fp8 = plan.filter(pl.col("recipe") != "bf16")["site"].unique(maintain_order=True).to_list()
    demoted = {
        s: "in a failing set (round 0: 10 FP8 site(s): 0.826x bf16 [0.746, 0.921], predicted "
        "1.010x: slower than bf16); max_rounds (6) reached before it was measured alone"
        for s in fp8[:3]
    }
    summary = PlanSummary(
        sites=plan["site"].n_unique(), sites_fp8=len(fp8),
        passes_fp8=plan.filter(pl.col("recipe") != "bf16").height, gemm_speedup=1.16,
        prequant_speedup=1.58, gemm_share=0.2, predicted_speedup=1.031, ceiling=1.08,
        estimated=False, device="NVIDIA H200", measured_speedup=1.012,
        measured_interval=[1.004, 1.02], measured_confidence=0.9, measured_steps=360,
        measured_method="CUDA events", verified_sites=fp8[3:], verify_demoted=demoted,
        verify_rounds=[{"round": 0, "sites": len(fp8), "speedup": 0.98, "low": 0.95, "high": 1.01,
                        "predicted": 1.031, "verdict": "not shown to be as fast as bf16",
                        "steps": 60}],
        bf16_gemm_ms=40.0, safe_prequant_speedup=1.5,
    )  # fmt: skip
    summary.measured_bf16_step_ms = 100.0  # g = 0.4 of the measured bf16 step, not Probe's 0.2
    summary.predicted_from_step = 1.02
    return summary


def test_the_console_plan_fits_80_columns_one_line_per_site(capsys) -> None:
    plan = many_site_plan(40)
    summary = verified_summary(plan)
    lines = plan_lines(plan) + wrap_lines(summary.lines(), prefix="  ")
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    fp8_sites = plan.filter(pl.col("recipe") != "bf16")["site"].n_unique()
    site_lines = [line for line in lines if line.startswith("enco")]
    assert len(site_lines) == fp8_sites  # one line each, however long the name
    # The per-pass count says that most sites run only dgrad in FP8.
    assert "FP8 sites per pass: fwd 8, dgrad 35, wgrad 0" in lines
    assert any("site(s) dgrad;" in line or line.endswith("site(s) dgrad") for line in lines)
    # Every recipe can be read: in the line, or by a key listed under the table.
    text = "\n".join(lines)
    for recipe in RECIPES:
        assert recipe in text
    # Refusals are grouped by reason, not one line per pass; no reason repeats the numbers.
    assert "kept in bf16: 77 passes, by reason:" in lines
    assert sum("no FP8 candidate is safe" in line for line in lines) == 1
    assert "fastest safe choice" not in text
    assert any("ceiling as the measured bf16 step runs: 1.17" in line for line in summary.lines())
    # The plan summary's lines, the verification ones included, are all there, wrapped.
    flat = " ".join(" ".join(lines).split())
    for line in summary.lines():
        assert " ".join(line.split()) in flat, line
    assert len(lines) < 80
    print_lines(lines)  # printed as is: no markup read, no wrapping added
    printed = capsys.readouterr().out.splitlines()
    assert printed == lines


def test_all_sites_listed_with_show_all_still_fit() -> None:
    plan = many_site_plan(12)
    lines = plan_lines(plan, show_bf16=True)
    assert max(len(line) for line in lines) <= WIDTH
    assert sum(line.startswith("enco") for line in lines) == 12
    # Names longer than their column are cut (~) in their long words: the block index
    # that tells the sites apart stays.
    names = [line.split()[0] for line in lines if line.startswith("enco")]
    assert len(set(names)) == 12 and all("~" in n for n in names)
    assert any(".11." in n for n in names), names


@pytest.mark.parametrize("width", [60, 80, 100])
def test_other_widths(width: int) -> None:
    lines = plan_lines(many_site_plan(10), width=width)
    assert max(len(line) for line in lines) <= width


def _tiny_tables(plan: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`sites` and `site_errors` just rich enough for the report's figures."""
    names = plan["site"].unique(maintain_order=True).to_list()
    sites = pl.DataFrame({"site": names, "time_share": [None] * len(names)},
                         schema_overrides={"time_share": pl.Float64})  # fmt: skip
    errors = pl.DataFrame(
        [{"site": s, "pass": p, "recipe": RECIPES[0], "ucb_rel_err": 0.01 * (1 + k),
          "mean_rel_err": 0.01, "budget": 0.05, "verdict": "safe" if k < 4 else "unsafe"}
         for k, s in enumerate(names) for p in ("fwd", "dgrad", "wgrad")]
    )  # fmt: skip
    return sites, errors


def test_report_first_screen_says_what_runs_in_fp8_and_why_not() -> None:
    import importlib.util
    from pathlib import Path

    # The existing self-containment check, from its test module beside this one.
    spec = importlib.util.spec_from_file_location(
        "_cli_tests", Path(__file__).with_name("test_dispatch_cli.py")
    )
    cli_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_tests)

    from loka.dispatch.report import render_report

    plan = many_site_plan(40).with_columns(estimated=pl.lit(True))
    sites, errors = _tiny_tables(plan)
    page = render_report(sites=sites, site_errors=errors, plan=plan,
                         summary=verified_summary(plan))  # fmt: skip
    first = page[: page.index('id="summary"')]  # everything above the old summary list
    # Per pass, and the sites grouped by the passes they run in FP8.
    assert "36 of 40 sites" in first and "run at least one pass in FP8" in first
    assert re.search(r"<th>dgrad</th><td[^>]*>35 of 40</td>", first)
    assert re.search(r"<b>28 sites</b> run only <b>dgrad</b> in FP8", first)
    # Predicted and measured speedup, with the interval and the sites kept.
    assert "1.031x" in first and "1.012x" in first and "[1.004, 1.020]" in first
    assert "33 of 36 FP8 sites kept" in first
    # Refusals grouped: one row per reason with its count, not one per pass.
    assert "<b>77 passes stay bf16</b>, for 2 reason(s)" in first
    assert first.count("no FP8 candidate is safe here") == 1
    assert re.search(r"candidates: (slower than bf16|unsafe) \(\d+\); ", first)
    assert "<b>3 FP8 sites demoted by verification</b>" in first
    assert "in a failing set; max_rounds reached before it was measured alone" in first
    # The full table is still there, folded.
    assert "<details>\n<summary>The full plan: 120 rows" in page
    assert page.count('<tr class="fp8">') == plan.filter(pl.col("recipe") != "bf16").height
    cli_tests.assert_self_contained(page)


def test_reasons_group_without_their_numbers() -> None:
    from loka.dispatch.report.glance import reason_group

    assert reason_group("unsafe: error bound 0.1234 > budget 5e-2") == reason_group(
        "unsafe: error bound 7 > budget 0.05"
    )
    assert reason_group("bf16: no safe FP8 candidate is faster than bf16 here") == (
        "no safe FP8 candidate is faster than bf16 here"
    )
    assert (
        reason_group(
            "measured alone: round 4: 1 FP8 site(s): 0.993x bf16 [0.972, 1.021], predicted "
            "1.001x: not shown to be as fast as bf16"
        )
        == "measured alone: not shown to be as fast as bf16"
    )


def test_the_reports_speedup_card_names_the_ceiling_over_safe_candidates() -> None:
    from dataclasses import replace

    from loka.dispatch.report.glance import speedup_cards

    plan = many_site_plan(4)
    summary = verified_summary(plan)
    assert "accurate enough" not in speedup_cards(summary, plan)
    lower = replace(summary, safe_ceiling=1.05, safe_prequant_speedup=1.3)
    assert "1.050x over the candidates accurate enough" in speedup_cards(lower, plan)
    assert any("safe candidates only: 1.050x" in line for line in lower.lines())
    assert "allowed, quantizations included" not in speedup_cards(summary, plan)
    free = replace(summary, unconstrained_speedup=1.07)
    assert "1.070x with every FP8 candidate allowed" in speedup_cards(free, plan)
