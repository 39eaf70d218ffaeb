"""Closed loop: time the real training step with the plan against bf16, in place, and demote
FP8 sites until the planned step is not slower than bf16 with confidence.

Kernel timings predict a plan's gain; the step pays more than kernels (quantization
launches in an eager step, recompilation, allocator traffic), and plans predicted faster
have measured 0.82-1.05x bf16. So after `apply`, the step itself is measured:

- A round times one set of FP8 sites: blocks of `steps_per_block` steps alternate between
  the planned variant (those sites in FP8) and the bf16 variant (the model's original
  modules put back, same Parameters), P, B, P, B...; the first `drop` steps of every block
  are discarded (a switch may recompile or re-quantize). The first time a set is switched
  in, `settle_steps` more steps run untimed: under CUDA graphs (`mode="cudagraphs"`) a newly
  compiled set records a graph per input shape on its second call, so with k distinct
  shapes its first ~2k steps are slow, and one such block made a t-interval of three pairs
  useless (HSTU large: [0.26, 1.96] for a set measured at 1.008x). The speedup is median(bf16 block
  medians) / median(planned block medians), with a t-interval on the log ratios of the
  adjacent (P_i, B_i) pairs (`loka.dispatch.verify_stats`).
- A set passes when it is not slower than bf16 with confidence (speedup >= 1 and the
  interval's lower end >= 1 - tolerance) and, with `check_prediction`, the interval's upper
  end reaches what the plan predicts for it (else it gains less than predicted, beyond noise).
- Round 0 times every applied FP8 site. If that set does not pass, a bisection over groups
  of sites ordered by predicted gain: a group is added to the verified set when the
  verified set plus the group passes, a failing group is split in halves (higher predicted
  gain first), and a failing single site is demoted. At most `max_rounds` rounds.
- The outcome is the fastest measured set that was not slower than bf16 with confidence
  (every other site demoted, each with its reason), or bf16 everywhere when none was.
- Speed is not the only check. With `parameters` (`verifier_for` passes the model's), the
  last step of every block also says which parameters got a non-zero gradient: a set under
  which a parameter that every bf16 block of the round trains gets none (zero or missing)
  fails, whatever its speed ("changes the gradients"), and the search demotes the sites
  that cause it. A step that skips backward work is faster for the wrong reason: compiled
  FP8 linears once did exactly that under autocast (zero gradients upstream, see
  `loka.mods.dtypes`), and measured 1.01-1.18x "faster".

`Verifier` is the state machine (call `step()` after every training step: `Session` does);
`verify(step_fn, applied)` drives it by calling `step_fn()` itself.

Serving is verified the same way: with an inference plan (`PlanConfig(inference=True)`,
weights prequantized by `apply`), `step_fn` is one served forward (under `torch.no_grad()`,
at the serving batch, compiled as it will be served), the "step" time is the forward's, and
there is no gradient check. A demoted site serves bf16 and its prequantized copy is freed.
A plan faster by its kernels can be slower served: InterFormer large's 8-site serving plan,
predicted 1.006x, measured 0.996x (`bench/results/realized_20261204T210324Z`); verified, it
kept 4 sites and served 1.004x (`realized_20261205T023328Z`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import polars as pl
import torch

from loka.dispatch.step_timers import StepTimer, default_timer
from loka.dispatch.verify_stats import compare

__all__ = [
    "Verification",
    "VerifyConfig",
    "verify",
]

log = logging.getLogger("loka.dispatch")


@dataclass(frozen=True)
class VerifyConfig:
    """How the real step is timed and when a site is demoted.

    steps_per_block: training steps per block (one variant throughout).
    blocks: blocks per variant and round (>= 3: the interval has blocks - 1 degrees of freedom).
    drop: steps discarded at the start of each block (>= 1: the first step after a switch
        may recompile, under torch.compile, and re-quantize cached FP8 weights).
    tolerance: the planned step passes when its speedup's lower bound is >= 1 - tolerance
        (and the point estimate >= 1).
    confidence: two-sided level of the interval.
    max_rounds: measured sets at most (round 0, all FP8 sites, included). Under
        torch.compile each distinct set is one more compiled variant of the model.
    check_prediction: also search for a better set when the measured gain is below the
        plan's prediction beyond noise (the interval's upper end under the prediction).
    on_cpu: a `Session` also verifies a model on the CPU (where FP8 runs emulated, so the
        step time says nothing of the GPU the plan is for); off by default.
    settle_steps: untimed steps the first time each set is switched in (round 0's planned
        and bf16 sets, each later round's planned set). None: `steps_per_block` when the
        plan runs under CUDA graphs (mode "cudagraphs"), 0 otherwise (a compiled set
        recompiles once, on its first step, which `drop` covers).
    unit: what the search switches and demotes: "site" (all FP8 passes of a site together)
        or "pass" (each FP8 pass of a linear site on its own, ``"site/pass"``; a site whose
        forward pays and whose backward does not keeps its forward in FP8). Each distinct
        set is one more compiled variant under torch.compile, and there are up to three
        times as many units to bisect.
    """

    steps_per_block: int = 10
    blocks: int = 3
    drop: int = 2
    tolerance: float = 0.01
    confidence: float = 0.9
    max_rounds: int = 6
    check_prediction: bool = True
    on_cpu: bool = False
    unit: str = "site"
    settle_steps: int | None = None

    def __post_init__(self) -> None:
        if self.blocks < 3:
            raise ValueError(f"blocks must be >= 3, got {self.blocks}")
        if self.drop < 1:
            raise ValueError(f"drop must be >= 1 (the first step of a block), got {self.drop}")
        if self.steps_per_block <= self.drop:
            raise ValueError(
                f"steps_per_block ({self.steps_per_block}) must exceed drop ({self.drop})"
            )
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")
        if self.unit not in ("site", "pass"):
            raise ValueError(f"unit must be 'site' or 'pass', got {self.unit!r}")
        if self.settle_steps is not None and self.settle_steps < 0:
            raise ValueError(f"settle_steps must be >= 0, got {self.settle_steps}")

    def settle_for(self, mode: str | None) -> int:
        """Untimed steps for a newly switched-in set when the plan runs in `mode`."""
        if self.settle_steps is not None:
            return self.settle_steps
        return self.steps_per_block if mode == "cudagraphs" else 0

    @property
    def steps_per_round(self) -> int:
        return 2 * self.blocks * self.steps_per_block


@dataclass(frozen=True)
class Round:
    """One measured set of FP8 sites against bf16."""

    index: int
    active: tuple[str, ...]
    speedup: float
    low: float
    high: float
    predicted: float | None  # what the plan predicts for this set
    planned_ms: tuple[float, ...]  # block medians, in order
    bf16_ms: tuple[float, ...]
    accepted: bool  # not slower than bf16 with confidence (and no gradient lost)
    verdict: str
    steps: int
    lost_gradients: tuple[str, ...] = ()  # trained in every bf16 block, in no planned one

    def describe(self) -> str:
        predicted = f", predicted {self.predicted:.3f}x" if self.predicted is not None else ""
        return (
            f"round {self.index}: {len(self.active)} FP8 {_what(self.active)}: "
            f"{self.speedup:.3f}x bf16 "
            f"[{self.low:.3f}, {self.high:.3f}]{predicted}: {self.verdict}"
        )

    def as_dict(self) -> dict:
        return {
            "round": self.index, "sites": len(self.active), "speedup": self.speedup,
            "low": self.low, "high": self.high, "predicted": self.predicted,
            "verdict": self.verdict, "steps": self.steps,
            "lost_gradients": list(self.lost_gradients),
        }  # fmt: skip


@dataclass
class Verification:
    """What verification measured and decided."""

    sites: list[str]  # the FP8 sites verified (in order of predicted gain)
    kept: list[str]  # those left in FP8
    demoted: dict[str, str]  # the others, with the reason
    speedup: float  # measured for the kept set; 1.0 when none is kept (the step is bf16)
    low: float | None
    high: float | None
    predicted: float | None  # the plan's prediction for all verified sites
    predicted_kept: float | None
    rounds: list[Round]
    steps: int
    method: str
    confidence: float
    bf16_step_ms: float | None = None  # the bf16 step, median over every round's blocks

    def lines(self) -> list[str]:
        out = [r.describe() for r in self.rounds]
        if not self.kept:
            out.append(
                f"verified: no FP8 site kept, the step runs bf16 ({len(self.sites)} demoted, "
                f"{self.steps} steps measured)"
            )
        else:
            predicted = (
                f", predicted {self.predicted_kept:.3f}x" if self.predicted_kept is not None else ""
            )
            out.append(
                f"verified: {len(self.kept)} of {len(self.sites)} FP8 {_what(self.sites)} kept, step "
                f"{self.speedup:.3f}x bf16 [{self.low:.3f}, {self.high:.3f}]{predicted} "
                f"({self.steps} steps, {self.method})"
            )
        out += [f"  demoted {site}: {reason}" for site, reason in self.demoted.items()]
        return out


def _what(units: Iterable[str]) -> str:
    """What a set of verification units counts: sites, or passes ("site/pass")."""
    return "pass(es)" if any("/" in u for u in units) else "site(s)"


def site_gains(plan_table: pl.DataFrame, per_pass: bool = False) -> dict[str, float]:
    """Predicted kernel time saved per FP8 site of a plan (ms, summed over its passes), or
    with `per_pass` per ``"site/pass"``."""
    gains: dict[str, float] = {}
    for row in plan_table.iter_rows(named=True):
        if row["recipe"] == "bf16":
            continue
        saved = row["bf16_ms"] - row["predicted_ms"]
        if math.isfinite(saved):
            key = f"{row['site']}/{row['pass']}" if per_pass else row["site"]
            gains[key] = gains.get(key, 0.0) + saved
    return gains


def _halves(group: Sequence[str]) -> list[tuple[str, ...]]:
    mid = (len(group) + 1) // 2
    return [tuple(group[:mid]), tuple(group[mid:])]


class Verifier:
    """The verification state machine over a set of FP8 sites.

    `switch(active)` puts the sites in `active` in FP8 and every other one in bf16 (for an
    applied plan: `Applied.use`); `step()` is called after every training step and times it.
    `gains` (predicted saving per site, any unit; may cover more sites than verified) orders
    the bisection. The prediction for a set S of sites: with `saving_ms` (the kernel time
    each site saves per step, ms: `site_gains` of the plan), from the bf16 step time the
    round measured, T / (T - saving(S)); else, with `predicted` (the speedup predicted with
    every site of `gains` in FP8), 1 / (1 - (1 - 1/predicted) * gain(S) / gain(all)). The
    first needs no share of the step measured elsewhere: Probe's shares come from eager
    steps, longer than compiled ones, and understated compiled plans' gains (Wukong xl:
    share-based 1.030x, step-based 1.074x, measured 1.075x).
    `reduce(block_median)` makes the times agree across ranks (torch.distributed), so that
    every rank decides the same. `parameters()` (named parameters, e.g. the model's
    `named_parameters`) turns on the gradient check. When `done`, the switch holds the
    outcome and `result` is the `Verification`.
    """

    def __init__(
        self,
        sites: Iterable[str],
        switch: Callable[[frozenset[str]], None],
        config: VerifyConfig | None = None,
        timer: StepTimer | None = None,
        *,
        gains: Mapping[str, float] | None = None,
        predicted: float | None = None,
        saving_ms: Mapping[str, float] | None = None,
        reduce: Callable[[float], float] | None = None,
        on_event: Callable[[str], None] | None = None,
        method: str | None = None,
        parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        mode: str | None = None,
    ) -> None:
        self.config = config or VerifyConfig()
        self._settle = self.config.settle_for(mode)
        self._seen: set[frozenset[str]] = set()  # sets switched in so far
        self._settling = 0  # untimed steps left in this block
        self._parameters = parameters
        self._trained: list[frozenset[str]] = []  # per block of the round, as the medians
        self.gains = dict(gains or {})
        names = list(dict.fromkeys(sites))
        self.sites = sorted(names, key=lambda s: (-self.gains.get(s, 0.0), names.index(s)))
        self.predicted = predicted
        self.saving_ms = None if saving_ms is None else dict(saving_ms)
        self._switch = switch
        self._timer = timer if timer is not None else default_timer("cpu")
        self._reduce = reduce
        self._on_event = on_event
        self.method = method or getattr(self._timer, "method", type(self._timer).__name__)
        self.rounds: list[Round] = []
        self.steps = 0
        self.result: Verification | None = None
        self._searching = False
        self._kept: tuple[str, ...] = ()
        self._queue: list[tuple[str, ...]] = []
        self._group: tuple[str, ...] = ()
        self._alone: dict[str, str] = {}  # site -> why it failed when measured alone
        self._failed: dict[str, str] = {}  # site -> the last failing set it was part of
        self._active: tuple[str, ...] = ()
        self._medians: list[float] = []
        self._round_start = 0
        self._in_block = 0
        if not self.sites:
            self._finish()
            return
        cfg = self.config
        settle = f", {self._settle} untimed steps for each new set" if self._settle else ""
        self._event(
            f"verifying {len(self.sites)} FP8 {_what(self.sites)} on the real step ({self.method}): "
            f"planned/bf16 blocks of {cfg.steps_per_block} steps ({cfg.drop} dropped{settle}), "
            f"{cfg.steps_per_round} steps a round, at most {cfg.max_rounds} round(s)"
        )
        self._start_round(tuple(self.sites), ())

    @property
    def done(self) -> bool:
        return self.result is not None

    def predicted_for(
        self, active: Iterable[str], bf16_step_ms: float | None = None
    ) -> float | None:
        """The plan's predicted step speedup with only `active` in FP8 (from the bf16 step
        time when `saving_ms` and `bf16_step_ms` are known)."""
        if self.saving_ms is not None and bf16_step_ms is not None and bf16_step_ms > 0:
            saving = sum(self.saving_ms.get(s, 0.0) for s in active)
            return bf16_step_ms / (bf16_step_ms - saving) if saving < bf16_step_ms else None
        total = sum(self.gains.values())
        if self.predicted is None or total <= 0:
            return None
        saving = (1.0 - 1.0 / self.predicted) * sum(self.gains.get(s, 0.0) for s in active)
        return 1.0 / (1.0 - saving / total)

    def step(self) -> None:
        """A training step ended (after the optimizer step)."""
        if self.done:
            return
        self.steps += 1
        if self._settling:
            self._settling -= 1
            if not self._settling:
                self._timer.start()  # the block's timing starts after the settling steps
            return
        self._timer.mark()
        self._in_block += 1
        if self._in_block < self.config.steps_per_block:
            return
        times = self._timer.collect()[self.config.drop :]
        if self._parameters is not None:
            self._trained.append(trained(self._parameters()))
        median = statistics.median(times)
        self._medians.append(self._reduce(median) if self._reduce is not None else median)
        if len(self._medians) < 2 * self.config.blocks:
            self._start_block()
        else:
            self._end_round()

    # -- internals -----------------------------------------------------------------------

    def _event(self, text: str) -> None:
        log.info("loka: %s", text)
        if self._on_event is not None:
            self._on_event(text)

    def _start_round(self, active: tuple[str, ...], group: tuple[str, ...]) -> None:
        self._active = tuple(s for s in self.sites if s in set(active))
        self._group = group
        self._medians = []
        self._trained = []
        self._round_start = self.steps
        self._start_block()

    def _start_block(self) -> None:
        planned = len(self._medians) % 2 == 0
        units = frozenset(self._active) if planned else frozenset()
        self._switch(units)
        self._in_block = 0
        self._settling = 0 if units in self._seen else self._settle
        self._seen.add(units)
        if not self._settling:  # else `step` starts the timer once the set has settled
            self._timer.start()

    def _measure(self) -> Round:
        cfg = self.config
        cmp = compare(self._medians[0::2], self._medians[1::2], cfg.confidence)
        predicted = self.predicted_for(self._active, 1e3 * statistics.median(self._medians[1::2]))
        lost: tuple[str, ...] = ()
        if self._trained:
            always = frozenset.intersection(*self._trained[1::2])
            ever = frozenset().union(*self._trained[0::2])
            lost = tuple(sorted(always - ever))
        accepted = cmp.speedup >= 1.0 and cmp.low >= 1.0 - cfg.tolerance and not lost
        if lost:
            shown = ", ".join(lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
            verdict = f"changes the gradients: {len(lost)} parameter(s) get none ({shown})"
        elif cmp.high < 1.0:
            verdict = "slower than bf16"
        elif not accepted:
            verdict = "not shown to be as fast as bf16"
        elif cfg.check_prediction and predicted is not None and cmp.high < predicted:
            verdict = "not slower than bf16, below the prediction"
        else:
            verdict = "not slower than bf16"
        return Round(
            index=len(self.rounds), active=self._active, speedup=cmp.speedup, low=cmp.low,
            high=cmp.high, predicted=predicted,
            planned_ms=tuple(1e3 * t for t in self._medians[0::2]),
            bf16_ms=tuple(1e3 * t for t in self._medians[1::2]),
            accepted=accepted, verdict=verdict, steps=self.steps - self._round_start,
            lost_gradients=lost,
        )  # fmt: skip

    def _end_round(self) -> None:
        measured = self._measure()
        self.rounds.append(measured)
        self._event(measured.describe())
        passed = measured.verdict == "not slower than bf16"
        if not self._searching:
            if passed:
                return self._finish()
            self._searching = True
            for site in measured.active:
                self._failed[site] = measured.describe()
            if len(self.sites) == 1:
                self._alone[self.sites[0]] = f"measured alone: {measured.describe()}"
                return self._finish()
            self._queue = _halves(self.sites)
        elif passed:
            self._kept = measured.active
        else:
            for site in self._group:
                self._failed[site] = measured.describe()
            if len(self._group) == 1:
                base = len(measured.active) - 1
                on = f"on top of {base} verified site(s)" if base else "alone"
                self._alone[self._group[0]] = f"measured {on}: {measured.describe()}"
            else:
                self._queue[:0] = _halves(self._group)
        if self._queue and len(self.rounds) < self.config.max_rounds:
            group = self._queue.pop(0)
            return self._start_round(self._kept + group, group)
        self._finish()

    def _finish(self) -> None:
        bf16_ms = (
            statistics.median(t for r in self.rounds for t in r.bf16_ms) if self.rounds else None
        )
        accepted = [r for r in self.rounds if r.accepted]
        best = max(accepted, key=lambda r: (r.speedup, len(r.active)), default=None)
        kept = best.active if best is not None else ()
        self._switch(frozenset(kept))
        demoted = {}
        for site in self.sites:
            if site in kept:
                continue
            if site in self._alone:
                demoted[site] = self._alone[site]
            elif any(site in r.active for r in accepted):
                demoted[site] = (
                    f"round {best.index} without it was faster ({best.speedup:.3f}x bf16)"
                )
            elif site in self._failed:
                demoted[site] = (
                    f"in a failing set ({self._failed[site]}); max_rounds "
                    f"({self.config.max_rounds}) reached before it was measured alone"
                )
            else:
                demoted[site] = f"not measured: max_rounds ({self.config.max_rounds}) reached"
        self.result = Verification(
            sites=list(self.sites), kept=list(kept), demoted=demoted,
            speedup=best.speedup if best is not None else 1.0,
            low=best.low if best is not None else None,
            high=best.high if best is not None else None,
            predicted=self.predicted_for(self.sites, bf16_ms),
            predicted_kept=self.predicted_for(kept, bf16_ms), bf16_step_ms=bf16_ms,
            rounds=list(self.rounds), steps=self.steps, method=self.method,
            confidence=self.config.confidence,
        )  # fmt: skip
        for line in self.result.lines()[len(self.rounds) :]:
            self._event(line)


def trained(parameters: Iterable[tuple[str, torch.Tensor]]) -> frozenset[str]:
    """Names of the parameters holding a non-zero dense gradient (one device sync)."""
    named = [
        (name, p.grad)
        for name, p in parameters
        if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel() > 0
    ]
    if not named:
        return frozenset()
    norms = torch._foreach_norm([g for _, g in named])
    flags = (torch.stack([n.float().to(norms[0].device) for n in norms]) != 0).tolist()
    return frozenset(name for (name, _), flag in zip(named, flags, strict=True) if flag)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def verifier_for(
    applied,
    config: VerifyConfig | None = None,
    timer: StepTimer | None = None,
    **kwargs,
) -> Verifier:
    """A `Verifier` over the live FP8 sites of an `Applied` (`loka.dispatch.apply`'s result),
    switching them with `Applied.use`; predictions from its plan; the gradient check on the
    model's parameters (none for an inference plan, whose step is a served forward).
    `timer` defaults to CUDA events on a GPU model, the wall clock elsewhere. `mode=` (the
    plan's execution mode) sets the default `settle_steps`."""
    config = config or VerifyConfig()
    per_pass = config.unit == "pass"
    if per_pass:
        live, switch = applied.pass_units(), applied.use_units
        gains = site_gains(applied.plan.table, per_pass=True)
        gains |= {u: v for u, v in site_gains(applied.plan.table).items() if u in live}
    else:
        live, switch = [s for s in applied.sites if s not in applied.demoted], applied.use
        gains = site_gains(applied.plan.table)
    timer = timer if timer is not None else default_timer(_model_device(applied.model))
    # A served forward trains nothing: no gradient to check.
    serving = applied.plan.metadata.get("inference") == "True"
    parameters = kwargs.pop("parameters", None if serving else applied.model.named_parameters)
    return Verifier(
        live, switch, config, timer, gains=gains,
        predicted=applied.plan.summary.predicted_speedup,
        saving_ms=gains, parameters=parameters, **kwargs,
    )  # fmt: skip


def settle(applied, result: Verification) -> None:
    """Make the outcome permanent: the kept sites in FP8, every other one demoted with
    `Applied.demote` (its reason recorded), and the measurement written into the plan's
    summary (and the summary metadata a saved plan carries)."""
    if any("/" in u for u in [*result.kept, *result.demoted]):
        applied.use_units(result.kept)
        for unit, reason in result.demoted.items():
            site, _, pass_ = unit.rpartition("/")
            if pass_:
                applied.demote_pass(site, pass_, f"verify: {reason}")
            else:
                applied.demote(unit, f"verify: {reason}")
    else:
        applied.use(s for s in result.kept if s not in applied.demoted)
        for site, reason in result.demoted.items():
            applied.demote(site, f"verify: {reason}")
    summary = applied.plan.summary
    summary.measured_speedup = result.speedup
    summary.measured_interval = (
        [result.low, result.high] if result.low is not None and result.high is not None else None
    )
    summary.measured_confidence = result.confidence
    summary.measured_steps = result.steps
    summary.measured_method = result.method
    summary.verified_sites = list(result.kept)
    summary.verify_demoted = dict(result.demoted)
    summary.verify_rounds = [r.as_dict() for r in result.rounds]
    summary.measured_bf16_step_ms = result.bf16_step_ms
    summary.predicted_from_step = result.predicted_kept if result.bf16_step_ms else None
    if "summary" in applied.plan.metadata:  # as the planner writes it
        applied.plan.metadata["summary"] = json.dumps(
            {k: v for k, v in summary.__dict__.items() if k != "notes"}
        )


def allow_recompiles(config: VerifyConfig, on_event: Callable[[str], None] | None = None) -> None:
    """Each set of FP8 sites verification tries is one more compiled variant of the model;
    past dynamo's recompile limit (8 by default) the model would silently run uncompiled
    and the timings would measure eager steps. Raise the limit to cover them (a global
    dynamo setting: said through `on_event`)."""
    import torch._dynamo

    needed = 2 * config.max_rounds + 4  # every set and bf16, plus the warm-up's graphs
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
        if on_event is not None:
            on_event(f"torch._dynamo.config.recompile_limit raised to {needed} for verification")


def verify(
    step_fn: Callable[[], object],
    applied,
    config: VerifyConfig | None = None,
    timer: StepTimer | None = None,
    *,
    on_event: Callable[[str], None] | None = None,
    mode: str | None = None,
) -> Verification:
    """Verify an applied plan on the real step: call `step_fn()` (one whole training step,
    optimizer included) until the `Verifier` is done, then `settle`. Uses at most
    ``config.max_rounds * config.steps_per_round`` steps plus the settling steps of each new
    set (`VerifyConfig.settle_steps`, by `mode`); none when no site is in FP8. A compiled
    `mode` ("compiled", "cudagraphs") raises dynamo's recompile limit to cover every set
    (`allow_recompiles`)."""
    if mode is not None and mode != "eager":
        allow_recompiles(config or VerifyConfig(), on_event)
    verifier = verifier_for(applied, config, timer, on_event=on_event, mode=mode)
    while not verifier.done:
        step_fn()
        verifier.step()
    settle(applied, verifier.result)
    return verifier.result
