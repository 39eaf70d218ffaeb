"""`PlanSummary`: what a plan predicts end to end (the GEMM speedup, the end-to-end speedup
beside its ceiling), the notes that explain it, and after verification what was measured."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields

import polars as pl

from loka.dispatch.planner.candidates import SiteChoice
from loka.schema import PASSES


@dataclass
class PlanSummary:
    """What the plan predicts, end to end (DESIGN.md, Principles)."""

    sites: int
    sites_fp8: int
    passes_fp8: int
    gemm_speedup: float  # bf16 GEMM time of the planned sites / planned time
    prequant_speedup: float  # s: pre-quantized FP8 GEMM speedup at these shapes (best backend)
    gemm_share: float | None  # g: share of step time in these GEMMs (sites.time_share)
    predicted_speedup: float | None  # 1 / ((1 - g) + sum_i g_i / s_i)
    ceiling: float | None  # 1 / ((1 - g) + g / s)
    estimated: bool
    device: str
    notes: list[str] = field(default_factory=list)
    # Measured on the real training step after apply (loka.dispatch.verify; None: not
    # verified): the kept FP8 sites' step speedup over bf16 with its interval, and every
    # site verification demoted, with the reason.
    measured_speedup: float | None = None
    measured_interval: list[float] | None = None  # [low, high] at measured_confidence
    measured_confidence: float | None = None
    measured_steps: int | None = None
    measured_method: str | None = None
    verified_sites: list[str] | None = None
    verify_demoted: dict[str, str] = field(default_factory=dict)
    verify_rounds: list[dict] = field(default_factory=list)
    # The bf16 step verification measured (ms) and the prediction for the kept sites from
    # it: step / (step - kernel time the kept sites save), no share measured elsewhere.
    measured_bf16_step_ms: float | None = None
    predicted_from_step: float | None = None
    # FP8 candidates refused only because their verdict was undecided, and about how many
    # sampled batches would decide them (`undecided_note`); None when there were none.
    undecided: str | None = None
    # The undecided candidates that would change the plan if they were decided safe
    # (`planner.undecided.UndecidedStakes.as_dict`: how many, their passes, what that plan
    # predicts, and about how many sampled batches would decide most of them); None when
    # no undecided verdict holds the plan back. `Session(decide_steps=...)` probes on for them.
    undecided_stakes: dict | None = None
    # The ceiling over the candidates the plan may take (safe, allowed): s counted on each
    # pass's fastest such GEMM. ceiling -> safe_ceiling is lost to accuracy (passes no FP8
    # recipe is safe for); safe_ceiling -> predicted to quantization and shared-pass costs.
    safe_prequant_speedup: float | None = None
    safe_ceiling: float | None = None
    # The prediction with every timed FP8 candidate allowed, accurate or not, each pass at its
    # fastest whole (quantizations included): ceiling -> unconstrained is what quantizing
    # costs (memory-bound GEMMs over many tokens can lose it all); unconstrained -> predicted
    # is what accuracy and the plan's rules cost.
    unconstrained_speedup: float | None = None
    # The bf16 kernel time of the planned passes of the timed sites (ms per step). With a
    # measured bf16 step (`measured_bf16_step_ms`, from verification or bench/realized.py)
    # it gives g as that step runs them, and the ceilings from it (`*_from_step`). Probe's
    # share g (above) comes from an eager step, whose unfused elementwise work a compiled
    # step does not have, so under torch.compile it understates g and the ceiling (DHEN xl:
    # 0.27 from Probe, 0.64 of the compiled step; ceiling 1.135x vs 1.389x).
    bf16_gemm_ms: float | None = None

    @classmethod
    def from_dict(cls, values: dict) -> PlanSummary:
        """A summary as `__dict__` wrote it, keys no longer fields ignored (a plan saved by
        an earlier version may carry some)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    @property
    def gemm_share_from_step(self) -> float | None:
        """g = `bf16_gemm_ms` over the measured bf16 step; None where either is unknown or
        g is not below 1 (GEMMs timed apart that exceed the step: the two disagree)."""
        step, gemm = self.measured_bf16_step_ms, self.bf16_gemm_ms
        if not step or not gemm or not 0 < gemm < step:
            return None
        return gemm / step

    def _ceiling_from_step(self, s: float | None) -> float | None:
        g = self.gemm_share_from_step
        return None if g is None or not s else 1.0 / ((1.0 - g) + g / s)

    @property
    def ceiling_from_step(self) -> float | None:
        """1/((1-g)+g/s) with g from the measured step and the plan's s (every candidate)."""
        return self._ceiling_from_step(self.prequant_speedup)

    @property
    def safe_ceiling_from_step(self) -> float | None:
        """The same with s over the safe candidates only."""
        return self._ceiling_from_step(self.safe_prequant_speedup)

    @property
    def share_of_ceiling(self) -> float | None:
        if self.predicted_speedup is None or self.ceiling is None or self.ceiling <= 1.0:
            return None
        return (self.predicted_speedup - 1.0) / (self.ceiling - 1.0)

    def lines(self) -> list[str]:
        est = " (ESTIMATED from a recorded table, not measured here)" if self.estimated else ""
        out = [
            f"device: {self.device}{est}",
            f"sites: {self.sites}, in FP8: {self.sites_fp8} sites / {self.passes_fp8} passes",
            f"GEMM time of the planned sites: {self.gemm_speedup:.2f}x bf16{est}",
            f"pre-quantized FP8 GEMM speedup at these shapes (s): {self.prequant_speedup:.2f}x",
        ]
        if self.gemm_share is None:
            out.append(
                "end-to-end: not predicted, the GEMM share of step time g is unknown "
                "(sites.time_share is measured on CUDA only)"
            )
        else:
            out.append(
                f"end-to-end: predicted {self.predicted_speedup:.3f}x, ceiling "
                f"1/((1-g)+g/s) = {self.ceiling:.3f}x with g = {self.gemm_share:.3f}{est}"
            )
            if self.safe_ceiling is not None and self.safe_ceiling < self.ceiling - 5e-4:
                out.append(
                    f"ceiling over the safe candidates only: {self.safe_ceiling:.3f}x "
                    f"(s = {self.safe_prequant_speedup:.2f}x): the rest of the ceiling is "
                    "passes no FP8 recipe is accurate enough for"
                )
            if self.unconstrained_speedup is not None:
                out.append(
                    f"with every timed FP8 candidate allowed, accurate or not, quantizations "
                    f"included: {self.unconstrained_speedup:.3f}x (ceiling -> this: what "
                    "quantizing costs; this -> predicted: what accuracy and the plan's rules "
                    "cost)"
                )
        undecided = [self.undecided] if self.undecided else []
        if self.undecided_stakes:
            undecided.append(self.stakes_line())
        return out + undecided + self.notes + self._measured_lines()

    def _stakes_predicted(self) -> bool:
        """Whether the stakes compare end-to-end predictions (else GEMM speedups)."""
        stakes = self.undecided_stakes or {}
        return self.predicted_speedup is not None and stakes.get("predicted_speedup") is not None

    @property
    def undecided_gain(self) -> float | None:
        """How much faster the plan would be were `undecided_stakes` decided safe: the
        relative gain of the end-to-end prediction (of the GEMM speedup where no
        end-to-end prediction is made); None without stakes."""
        stakes = self.undecided_stakes
        if not stakes:
            return None
        if self._stakes_predicted():
            return stakes["predicted_speedup"] / self.predicted_speedup - 1.0
        return stakes["gemm_speedup"] / self.gemm_speedup - 1.0

    def stakes_change(self) -> str:
        """What deciding `undecided_stakes` safe would change, in words."""
        stakes = self.undecided_stakes or {}
        if self._stakes_predicted():
            return f"predicted {self.predicted_speedup:.3f}x -> {stakes['predicted_speedup']:.3f}x"
        return f"GEMM time {self.gemm_speedup:.2f}x -> {stakes['gemm_speedup']:.2f}x bf16"

    def stakes_line(self) -> str:
        """One line on `undecided_stakes` (which `lines()` prints after the undecided note)."""
        stakes = self.undecided_stakes or {}
        n, passes = stakes["candidates"], len(stakes["passes"])
        gain = self.stakes_change()
        batches = stakes.get("batches")
        decide = (
            f"; about {batches} sampled batches in all would decide most of them"
            if batches is not None
            else ""
        )
        return (
            f"of those, {n} would change this plan ({passes} pass(es)) if decided safe: "
            f"{gain}{decide}"
        )

    def _measured_lines(self) -> list[str]:
        if self.measured_speedup is None:
            return []
        kept = len(self.verified_sites or [])
        total = kept + len(self.verify_demoted)
        if self.measured_interval is None:
            measured = "no FP8 site kept: the step runs bf16 (1.000x)"
        else:
            low, high = self.measured_interval
            measured = (
                f"{self.measured_speedup:.3f}x bf16 [{low:.3f}, {high:.3f}] "
                f"({self.measured_confidence:.0%} interval) with {kept} of {total} FP8 site(s)"
            )
        predicted = (
            f"; predicted {self.predicted_speedup:.3f}x"
            if self.predicted_speedup is not None else ""
        )  # fmt: skip
        if self.predicted_from_step is not None:
            predicted += (
                f", {self.predicted_from_step:.3f}x for the kept sites from the measured bf16 "
                f"step ({self.measured_bf16_step_ms:.2f} ms)"
            )
        out = [
            f"end-to-end: measured on the real step {measured}{predicted} "
            f"({self.measured_steps} steps, {self.measured_method})"
        ]
        if self.ceiling_from_step is not None:
            safe = (
                f" (safe candidates only {self.safe_ceiling_from_step:.3f}x)"
                if self.safe_ceiling_from_step is not None else ""
            )  # fmt: skip
            reached = (
                f"; measured reaches {(self.measured_speedup - 1) / (self.ceiling_from_step - 1):.0%} "
                "of its gain"
                if self.measured_interval is not None and self.ceiling_from_step > 1.0 else ""
            )  # fmt: skip
            out.append(
                f"ceiling as the measured bf16 step runs: {self.ceiling_from_step:.3f}x{safe} with "
                f"g = {self.gemm_share_from_step:.3f} (the planned sites' bf16 GEMM kernels over "
                f"the step){reached}"
            )
        return out + [f"demoted by verification: {s}: {r}" for s, r in self.verify_demoted.items()]


def batches_to_decide(err: dict) -> int | None:
    """About how many sampled batches would decide an undecided site_errors row: the n at
    which the Student-t half-width, with the standard deviation measured so far, leaves the
    mean on one side of the budget (normal quantile; at least the batches already seen + 1).
    None when too few batches were seen to have a standard deviation."""
    n, mean, std = err["n"], err["mean_rel_err"], err.get("std_rel_err")
    if std is None or n < 2 or not math.isfinite(std) or mean is None:
        return None
    gap = abs(err["budget"] - mean)
    if gap == 0:
        return None
    z = statistics.NormalDist().inv_cdf(err.get("confidence") or 0.95)
    return max(n + 1, math.ceil((z * std / gap) ** 2))


def undecided_note(rows: list[dict]) -> str | None:
    """One line on the FP8 candidates refused because their verdict was undecided: how many,
    after how many batches, and about how many sampled batches would decide most of them."""
    if not rows:
        return None
    seen = sorted({int(r["n"]) for r in rows})
    after = f"{seen[0]}" if len(seen) == 1 else f"{seen[0]}-{seen[-1]}"
    needs = sorted(x for r in rows if (x := batches_to_decide(r)) is not None)
    text = (
        f"{len(rows)} FP8 candidate(s) refused as undecided after {after} sampled batch(es) "
        "(their error bounds straddle the budget)"
    )
    if needs:
        most = needs[min(len(needs) - 1, (3 * len(needs)) // 4)]
        text += (
            f"; about {most} sampled batches would decide most of them (median {needs[len(needs) // 2]}): "
            "probe longer, e.g. more warm-up steps"
        )
    else:
        text += "; too few batches to estimate how many would decide them: probe longer"
    return text


_UNMEASURED = ("time ESTIMATED, not measured", "no kernel_bench row")


def _unmeasured_sites(choices: list[SiteChoice]) -> list[str]:
    """Sites (largest time share first) with a candidate refused only for lack of a
    measurement: what a larger bench budget could still turn to FP8."""
    found = [
        c for c in choices
        if any(r["reason"].startswith(_UNMEASURED) for rows in c.rejected.values() for r in rows)
    ]  # fmt: skip
    found.sort(key=lambda c: -(c.share or 0.0))
    return [c.site for c in found]


def summarize(
    choices: list[SiteChoice],
    table: pl.DataFrame,
    devices: list,
    gemm_share: float | None,
    notes: list[str],
    passes: tuple[str, ...],
) -> PlanSummary:
    """What the plan predicts end to end, against its ceiling (DESIGN.md, Principles)."""
    timed = [c for c in choices if c.note is None]
    index = [PASSES.index(p) for p in passes]

    def planned(c: SiteChoice) -> float:
        return sum(c.current().times[i] for i in index)

    def bf16(c: SiteChoice) -> float:
        return sum(c.bf16[p].median_ms for p in passes)

    bf16_total = sum(bf16(c) for c in timed)
    plan_total = sum(planned(c) for c in timed)
    # s is about the hardware: the best pre-quantized GEMM among all timed FP8 candidates,
    # safe or not, against bf16.
    prequant_total = sum(
        min(c.best_gemm.get(p, math.inf), c.bf16[p].gemm_ms) for c in timed for p in passes
    )
    s_prequant = bf16_total / prequant_total if prequant_total > 0 else 1.0
    safe_total = sum(
        min([o.gemm_ms for o in c.options.get(p, [])] + [c.bf16[p].gemm_ms])
        for c in timed for p in passes
    )  # fmt: skip
    s_safe = bf16_total / safe_total if safe_total > 0 else 1.0
    shares = [c.share for c in timed]
    g = None
    predicted = ceiling = unconstrained = None

    def fastest(c: SiteChoice) -> float:
        # Never above the plan's own time for a pass, which may share a quantization with
        # another pass that a per-pass best cannot see.
        times = c.current().times
        return sum(min(c.best_total.get(p, math.inf), times[i])
                   for p, i in zip(passes, index, strict=True))  # fmt: skip

    # sites.time_share is a share of the training step: it says nothing of inference.
    if timed and passes == PASSES and all(s is not None for s in shares):
        g = float(sum(shares))
        predicted = 1.0 / ((1.0 - g) + sum(c.share * planned(c) / bf16(c) for c in timed))
        unconstrained = 1.0 / ((1.0 - g) + sum(c.share * fastest(c) / bf16(c) for c in timed))
    elif gemm_share is not None:
        g = gemm_share
        predicted = 1.0 / ((1.0 - g) + g * plan_total / bf16_total) if bf16_total > 0 else None
        fast_total = sum(fastest(c) for c in timed)
        if bf16_total > 0:
            unconstrained = 1.0 / ((1.0 - g) + g * fast_total / bf16_total)
        notes = [*notes, f"g = {g:.3f} given, not measured"]
    safe_ceiling = None
    if g is not None:
        ceiling = 1.0 / ((1.0 - g) + g / s_prequant)
        safe_ceiling = 1.0 / ((1.0 - g) + g / s_safe)
    unmeasured = _unmeasured_sites(choices)
    if unmeasured:
        shown = ", ".join(unmeasured[:5]) + (
            f" and {len(unmeasured) - 5} more" if len(unmeasured) > 5 else ""
        )
        notes = [*notes, f"{len(unmeasured)} site(s) have FP8 candidates the bench left "
                 f"unmeasured (budget spent or no row), so they were not considered: {shown}"]  # fmt: skip
    fp8 = table.filter(pl.col("recipe") != "bf16")
    # ESTIMATED when an FP8 choice rests on an estimate, or nothing was measured at all; a
    # measured plan whose bf16-only sites have estimated baselines says so in a note.
    estimated = bool(fp8["estimated"].any()) or not bool((~table["estimated"]).any())
    if not estimated and table["estimated"].any():
        notes = [*notes, f"{int(table['estimated'].sum())} of {table.height} bf16 baseline "
                 "time(s) are estimates (shapes not measured within the bench budget)"]  # fmt: skip
    return PlanSummary(
        sites=len(choices),
        sites_fp8=fp8["site"].n_unique(),
        passes_fp8=fp8.height,
        gemm_speedup=bf16_total / plan_total if plan_total > 0 else 1.0,
        prequant_speedup=s_prequant,
        gemm_share=g,
        predicted_speedup=predicted,
        ceiling=ceiling,
        estimated=estimated,
        device=devices[0].device if devices else "none",
        safe_prequant_speedup=s_safe,
        safe_ceiling=safe_ceiling,
        bf16_gemm_ms=bf16_total if timed else None,
        unconstrained_speedup=unconstrained,
        notes=[*list(notes), f"{len(choices) - len(timed)} site(s) without timings stay bf16"]
        if len(timed) < len(choices) else list(notes),
    )  # fmt: skip
