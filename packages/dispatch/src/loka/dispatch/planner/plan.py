"""`make_plan`: the `plan` table from the `sites`, `site_errors` and `kernel_bench` tables."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import polars as pl

from loka.dispatch.bench.cache import table_devices
from loka.dispatch.planner.budget import spend_error_budget
from loka.dispatch.planner.candidates import kernel_index, site_candidates
from loka.dispatch.planner.config import PlanConfig
from loka.dispatch.planner.rows import PLAN_TYPES, plan_rows
from loka.dispatch.planner.sharing import combine
from loka.dispatch.planner.summary import PlanSummary, summarize, undecided_note
from loka.dispatch.planner.undecided import undecided_stakes
from loka.schema import PASSES, empty, validate


@dataclass
class Plan:
    """A `plan` table, what it predicts, and the metadata written with it."""

    table: pl.DataFrame
    summary: PlanSummary
    metadata: dict[str, str]

    def fp8_sites(self) -> list[str]:
        return (
            self.table.filter(pl.col("recipe") != "bf16")["site"]
            .unique(maintain_order=True)
            .to_list()
        )

    def write(self, path) -> object:
        from loka.schema import write_table

        return write_table(self.table, path, "plan", metadata=self.metadata)


def _eager_share_note(summary: PlanSummary) -> str:
    """A compiled plan's prediction rests on Probe's time shares, measured on eager steps:
    a compiled step fuses the elementwise work around the GEMMs, so their share of it, and
    FP8's gain, are larger (DHEN xl: g 0.27 by Probe, 0.64 of the compiled bf16 step;
    predicted 1.02x, measured 1.10-1.14x)."""
    return (
        f"g = {summary.gemm_share:.3f} comes from eager steps (Probe); a compiled step fuses the "
        "work around the GEMMs, so their share there, and this plan's gain, are larger: the "
        "prediction is low for a compiled step; verification predicts from the measured bf16 "
        "step (PlanSummary.ceiling_from_step)"
    )


def _varying_m_sites(linear: pl.DataFrame) -> list[str]:
    """The sites whose token count M varied while Probe watched (jagged batches)."""
    return [r["site"] for r in linear.iter_rows(named=True) if r["M_min"] != r["M_max"]]


def _in_graph_note(choices: list) -> list[str]:
    """A compiled plan's note on the FP8 passes whose first quantization (a forward's x, a
    dgrad's dY) was costed fused into the op computing it (`PlanConfig.fuse_into_producer`),
    and what that saved."""
    chosen = [o for c in choices if c.note is None and c.combos for o in c.current().options]
    fused = [o for o in chosen if not o.is_bf16 and o.in_graph is not None]
    if not fused:
        return []
    saved = sum(o.in_graph_saved_ms for o in fused)
    passes = ", ".join(f"{sum(o.pass_ == p for o in fused)} {p}" for p in ("fwd", "dgrad"))
    return [
        f"{len(fused)} FP8 pass(es) ({passes}) costed with the quantization of x or dY fused "
        f"into the op computing it, as inductor compiles it ({saved:.3g} ms less than "
        "quantizing standalone; PlanConfig.fuse_into_producer)"
    ]


def _varying_m_note(linear: pl.DataFrame, choices: list) -> list[str]:
    """A compiled plan's note on FP8 sites whose token count M varied while Probe watched
    (jagged batches): under torch.compile's default a varying M makes the graph dynamic in
    M, and their quantizations were timed in static graphs. Tensor amaxes of token rows
    run in two stages there (`quantize_native(rows_vary=True)`), as fast as static; the
    reductions over M that remain (a transposed operand's row scales, the bias gradient)
    ran up to 2x slower. HSTU xl, jagged: 1.099x measured, 1.154x predicted from its step
    (1.040x before the two-stage amax)."""
    fp8 = {c.site for c in choices if c.combos and c.current().fp8_passes}
    varying = [site for site in _varying_m_sites(linear) if site in fp8]
    if not varying:
        return []
    shown = ", ".join(varying[:3]) + (f" and {len(varying) - 3} more" if len(varying) > 3 else "")
    return [
        f"{len(varying)} FP8 site(s) saw their token count M vary ({shown}): compiled with "
        "dynamic shapes, their quantizations run with M symbolic, and the bench timed them in "
        "static graphs; reductions over a symbolic M can run slower (HSTU xl, jagged, kept "
        "68% of the kernel time its plan predicted), so verify this plan on the real step"
    ]


def sites_fingerprint(sites: Iterable[tuple[str, int, int]]) -> str:
    """A hash of a model's linear sites (name, K, N): what a plan was made for."""
    items = sorted((str(s), int(k), int(n)) for s, k, n in sites)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def tables_fingerprint(sites: pl.DataFrame) -> str:
    """`sites_fingerprint` of a `sites` table's plannable sites (linear, one group): the
    model fingerprint a plan made from that table records."""
    linear = sites.filter((pl.col("kind") == "linear") & (pl.col("groups") == 1))
    return sites_fingerprint((r["site"], r["K"], r["N"]) for r in linear.iter_rows(named=True))


def make_plan(
    sites: pl.DataFrame,
    site_errors: pl.DataFrame,
    kernel_bench: pl.DataFrame,
    config: PlanConfig | None = None,
    *,
    gemm_share: float | None = None,
) -> Plan:
    """Plan every linear site of `sites` from `site_errors` and `kernel_bench`: tables only,
    so a plan can be made from saved files with no model, Probe or GPU at hand.

    `gemm_share` overrides g (the share of step time in these GEMMs) when `sites` has no
    measured `time_share` (Probe measures it on CUDA only). A site whose `norm` column names
    the norm feeding it alone also weighs fusing that norm with the forward's quantization
    (column `fuse_norm`), costed from the kernel_bench norm rows (N = 0).
    """
    config = config or PlanConfig()
    sites = validate(sites, "sites")
    site_errors = validate(site_errors, "site_errors")
    kernel_bench = validate(kernel_bench, "kernel_bench")
    devices = table_devices(kernel_bench)
    if len(devices) > 1:
        raise ValueError(
            "kernel_bench holds rows of several machines: "
            + "; ".join(d.describe() for d in devices)
            + ". Plan for one: filter the table by device first"
        )
    if gemm_share is not None and not 0 <= gemm_share <= 1:
        raise ValueError(f"gemm_share must be in [0, 1], got {gemm_share}")
    kernels = kernel_index(kernel_bench)
    if config.allow_estimated is None:
        measured_here = bool((~kernel_bench["estimated"]).any())
        config = dataclasses.replace(config, allow_estimated=not measured_here)
    errors: dict[str, dict[str, list[dict]]] = {}
    for row in site_errors.iter_rows(named=True):
        errors.setdefault(row["site"], {}).setdefault(row["pass"], []).append(row)
    linear = sites.filter((pl.col("kind") == "linear") & (pl.col("groups") == 1))
    choices = []
    for site in linear.iter_rows(named=True):
        choice = site_candidates(site, errors.get(site["site"], {}), kernels, config)
        if choice.note is None:
            choice.combos = combine(choice, config)
        choices.append(choice)
    notes = spend_error_budget(choices, config)
    if config.mode != "eager":
        notes += _varying_m_note(linear, choices) + _in_graph_note(choices)
    skipped = sites.height - linear.height
    if skipped:
        notes.append(f"{skipped} grouped/bmm site(s) not planned (linear sites only)")
    rows = [r for c in choices for r in plan_rows(c, config)]
    if rows:
        table = validate(pl.DataFrame(rows, schema_overrides=PLAN_TYPES), "plan")
    else:  # no linear site to plan: an empty plan, not a frame without columns
        notes.append("no linear site with a known shape: nothing to plan")
        table = empty("plan")
    passes = ("fwd",) if config.inference else PASSES
    summary = summarize(choices, table, devices, gemm_share, notes, passes)
    undecided = [e for c in choices for e in c.undecided]
    summary.undecided = undecided_note(undecided)
    if undecided and not config.allow_undecided:

        def optimistic() -> tuple[pl.DataFrame, float | None, float]:
            bold = dataclasses.replace(config, allow_undecided=True)
            plan = make_plan(sites, site_errors, kernel_bench, bold, gemm_share=gemm_share)
            return plan.table, plan.summary.predicted_speedup, plan.summary.gemm_speedup

        stakes = undecided_stakes(table, undecided, optimistic)
        summary.undecided_stakes = None if stakes is None else stakes.as_dict()
    eager_shares = config.mode != "eager" and not config.inference and gemm_share is None
    if eager_shares and summary.predicted_speedup is not None:
        summary.notes.append(_eager_share_note(summary))
    metadata = {
        "producer": "loka-dispatch planner",
        "model_fingerprint": tables_fingerprint(sites),
        "sites": json.dumps({r["site"]: [r["K"], r["N"]] for r in linear.iter_rows(named=True)}),
        # Sites whose token count M varied under Probe (jagged batches): `apply` sets their
        # Fp8LinearConfig.tokens_vary (two-stage tensor amax under a symbolic M).
        "tokens_vary": json.dumps(_varying_m_sites(linear)),
        "device": devices[0].describe() if devices else "none",
        "estimated": str(summary.estimated),
        "config": repr(config),
        "inference": str(config.inference),
        "summary": json.dumps({k: v for k, v in summary.__dict__.items() if k != "notes"}),
    }
    return Plan(table, summary, metadata)
