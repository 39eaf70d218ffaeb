"""`Session`: LoKA in a training loop, a few lines.

    session = loka.dispatch.Session(model, SessionConfig(warmup_steps=200), sample=batch)
    for batch in batches:
        loss = loss_fn(model(batch)); loss.backward()
        if session.before_optimizer_step(optimizer):  # False: an overflow, step skipped
            optimizer.step()
        optimizer.zero_grad()
        session.step(loss)

(`session.guard_optimizer(optimizer)`, once, does the same through an optimizer hook for a
loop that calls `optimizer.step()` unconditionally.)

The first `warmup_steps` steps run in bf16 with Probe attached (more, up to `decide_steps`,
when undecided verdicts hold the plan back and more batches would decide them); then the
session plans (`loka.dispatch.make_plan` on the probed tables and kernel timings: measured on this GPU
through the cache, or estimated from the shipped table without one), applies the plan to
the model in place and arms the runtime guard. With `verify` (default on a GPU), the next
steps time the real step with the plan against bf16 (`loka.dispatch.verify`), switching
sites in place, and demote sites until the planned step is not slower than bf16. With `reprobe_every`, Probe is re-attached
every so many steps for `reprobe_steps` steps, and a site whose error drifted past its
budget is demoted to bf16. Under torch.distributed the tables are merged across ranks
(Probe's collectives), the plan is made on rank 0 and broadcast, and every rank applies it.
The optimizer needs nothing: converted modules keep the same Parameter objects.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch import nn

from loka.dispatch.apply_plan import Applied, ApplyConfig, apply
from loka.dispatch.bench import (
    BenchCache,
    CostModel,
    benchmark,
    site_norm_shapes,
    site_producer_shapes,
    site_recipes,
    site_shapes,
)
from loka.dispatch.bench.runner import mode_backends
from loka.dispatch.integrations.distributed import is_distributed, plan_once, rank
from loka.dispatch.integrations.eager_switch import EagerSwitch, compiled_in_place
from loka.dispatch.integrations.guard import GuardConfig, RuntimeGuard
from loka.dispatch.planner import Plan, PlanConfig, make_plan
from loka.dispatch.step_timers import StepTimer
from loka.dispatch.tables import read_plan
from loka.dispatch.verify import (
    Verifier,
    VerifyConfig,
    allow_recompiles,
    settle,
    verifier_for,
)
from loka.schema import read_table, write_table

log = logging.getLogger("loka.dispatch")


class UndecidedPlanWarning(UserWarning):
    """The warm-up ended before Probe could decide the FP8 verdicts: the plan is all bf16."""


def warmup_probe_config(steps: int):
    """Probe's schedule for a probing phase of `steps` steps before planning: every step of
    a short phase (under 100 steps), else every ``steps // 10``; every site each time; and
    an analysis queue that holds them all, so none is dropped; every site analysed on the
    GPU, from CUDA graphs after its second sampled step."""
    every = 1 if steps < 100 else steps // 10
    sampled = -(-steps // every)
    probe = _probe_module()
    # Every site on every sampled step: each one's analysis replays from a CUDA graph after
    # its second sampled step, so the small sites go to the GPU too (`loka.probe`'s README,
    # "CUDA graphs of the analysis": 1.64 -> 0.40 s per sampled step at DHEN large).
    return probe.ProbeConfig(
        every=every, warmup_steps=0, max_sites_per_step=None, queue_size=max(2, sampled),
        host_error_max_size=probe.DENSE_HOST_ERROR_MAX_SIZE,
    )  # fmt: skip


@dataclass(frozen=True)
class SessionConfig:
    """What a `Session` does and when.

    warmup_steps: bf16 steps with Probe before planning.
    decide_steps: at most this many more warm-up steps, taken when the plan made at the end
        of the warm-up would change were its undecided verdicts decided safe
        (`PlanSummary.undecided_stakes`) by more than `DECIDE_MIN_GAIN`: Probe stays
        attached, samples on at its schedule until about as many batches as would decide
        those verdicts, and the plan is then made again (with the same kernel timings).
        None (default): 4 x `warmup_steps` (`decide_limit`); 0: plan at `warmup_steps`,
        whatever is undecided. Deciding DHEN xl's forwards (60 sampled batches instead of
        10) took its measured compiled step from 1.061x to 1.115x bf16 on the H200, at
        about 2 s of Probe analysis per extra batch, once (before Probe's analysis replayed
        from CUDA graphs: 1.64 -> 0.40 s per batch at DHEN large on an H100's host).
    probe: a `loka.probe.ProbeConfig` (None: `warmup_probe_config(warmup_steps)`, a dense
        schedule: every step of a warm-up under 100 steps, else about 10 sampled steps, all
        sites each time; Probe's own defaults are for cheap monitoring of a whole run and
        would leave most verdicts undecided after a short warm-up).
    kernel_bench: a kernel_bench table (DataFrame or parquet path) to plan from; None:
        measure on this GPU (cached in `cache_dir`), or estimate from the shipped H200
        table where no FP8 GPU is present.
    gemm_share: g for the end-to-end prediction when Probe could not time sites (CPU).
    reprobe_every / reprobe_steps: re-attach Probe every N steps after applying, for M steps
        (counted from the end of verification).
    verify: time the real step, planned against bf16, after applying and demote sites until
        the planned step is not slower than bf16 with confidence (`VerifyConfig`); None: off.
        A model on the CPU is verified only with ``VerifyConfig(on_cpu=True)``.
    out_dir: write the probe tables, kernel_bench, plan and report there (rank 0); the plan
        is written again after verification and after every runtime demotion, so that it
        is always the plan as it runs (`Applied.record_demotions`).
    resume: a plan an earlier Session wrote (its `out_dir`, or the `plan.parquet` in it): the
        Session applies it at once, with the sites and passes that run had demoted demoted
        again, and skips warm-up, planning and verification. A restarted job (preemption, a
        resumed checkpoint) then trains with the same FP8 sites as before it stopped. Under
        torch.distributed rank 0 reads it and sends it to the others.
    """

    warmup_steps: int = 100
    decide_steps: int | None = None
    probe: Any = None
    plan: PlanConfig = field(default_factory=PlanConfig)
    apply: ApplyConfig = field(default_factory=ApplyConfig)
    guard: GuardConfig | None = field(default_factory=GuardConfig)
    kernel_bench: pl.DataFrame | str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    bench_budget_s: float | None = 180.0
    gemm_share: float | None = None
    reprobe_every: int | None = None
    reprobe_steps: int = 50
    verify: VerifyConfig | None = field(default_factory=VerifyConfig)
    out_dir: str | os.PathLike[str] | None = None
    resume: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if self.decide_steps is not None and self.decide_steps < 0:
            raise ValueError(f"decide_steps must be >= 0, got {self.decide_steps}")
        if self.reprobe_every is not None and self.reprobe_every <= self.reprobe_steps:
            raise ValueError("reprobe_every must be larger than reprobe_steps")
        if self.reprobe_steps < 1:
            raise ValueError(f"reprobe_steps must be >= 1, got {self.reprobe_steps}")

    @property
    def decide_limit(self) -> int:
        """`decide_steps` in force: None means 4 x `warmup_steps` (about 40 more sampled
        batches at the default warm-up schedule of 10)."""
        return 4 * self.warmup_steps if self.decide_steps is None else self.decide_steps


def _max_over_ranks(value: float) -> float:
    """The slowest rank's block time: a synchronous data-parallel step is as slow as it, and
    every rank then makes the same decision."""
    import torch.distributed as dist

    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _probe_module():
    from loka.dispatch.extras import require

    # Without it, plan from saved tables with loka.dispatch.make_plan.
    return require("loka.probe", "a Session (it probes the model during the warm-up)")


# A warm-up is extended to decide verdicts (`SessionConfig.decide_steps`) only for at least
# this much more predicted end-to-end speedup (or, without a prediction, GEMM speedup).
DECIDE_MIN_GAIN = 0.005


def steps_to_decide(summary, probe_config, step: int, limit: int) -> int:
    """About how many more steps Probe, sampling on at `probe_config`'s schedule from step
    `step`, needs to have sampled the batches that would decide the undecided candidates
    that hold the plan back (`PlanSummary.undecided_stakes`), at most `limit`; 0 when none
    is worth it (the plan would gain less than `DECIDE_MIN_GAIN`) or the batches needed are
    unknown."""
    stakes = summary.undecided_stakes
    if not stakes or not stakes.get("batches") or summary.undecided_gain < DECIDE_MIN_GAIN:
        return 0
    more, taken = stakes["batches"] - stakes.get("seen", 0), 0
    while more > 0 and taken < limit:
        more -= probe_config.is_sampled(step + taken)
        taken += 1
    return taken


class Session:
    """Warm-up with Probe, plan, apply, verify, guard; call `step()` after every optimizer
    step. Phases: "warmup", "verifying" (only with `SessionConfig.verify`), "applied".
    `timer` times verification steps (default: CUDA events on a GPU, else the wall clock)."""

    def __init__(
        self,
        model: nn.Module,
        config: SessionConfig | None = None,
        *,
        sample: Any = None,
        on_event: Callable[[str], None] | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Session needs an nn.Module, got {type(model).__name__}")
        # A torch.compile'd model: probe, plan and apply through the module it compiles (the
        # site names are that module's), and plan for compiled execution.
        self.model = getattr(model, "_orig_mod", model)
        self.compiled = self.model is not model or compiled_in_place(model)
        # While hooks watch the model, a compiled model runs eagerly (eager_switch).
        self._switch = EagerSwitch(model) if self.compiled else None
        self.config = config or SessionConfig()
        self.events: list[str] = []
        self.sample = sample
        self.on_event = on_event
        if self.compiled and self.config.plan.mode == "eager":
            plan = dataclasses.replace(self.config.plan, mode="compiled")
            self.config = dataclasses.replace(self.config, plan=plan)
            self._event(
                "the model is torch.compile'd: planning for mode 'compiled' (traceable "
                "backends only; set PlanConfig(mode='cudagraphs') for reduce-overhead)"
            )
        self.timer = timer
        self.steps = 0
        self.phase = "warmup"
        self.plan: Plan | None = None
        self.applied: Applied | None = None
        self.guard: RuntimeGuard | None = None
        self.verifier: Verifier | None = None
        self._verified_at: int | None = None  # step count when verification ended
        self.tables: dict[str, pl.DataFrame] = {}
        self.kernel_bench: pl.DataFrame | None = None
        self.nonfinite_losses = 0
        self.skipped_steps = 0  # optimizer steps skipped for non-finite gradients
        # The warm-up ends at this step count: `warmup_steps`, later by the steps taken to
        # decide verdicts (`decide_steps`), which are taken at most once.
        self.warmup_end = self.config.warmup_steps
        self._decided = self.config.decide_limit == 0
        self._pending_plan: Plan | None = None
        self._reprobe_start: int | None = None
        self.probe = None
        if self.config.resume is not None:
            self._resume(self.config.resume)
            self._sync_execution()
            return
        self.probe = self._attach_probe()
        self._event(f"warm-up: {self.config.warmup_steps} bf16 step(s) with Probe")
        if self.compiled:
            self._event(
                "the compiled model runs eagerly while Probe (and the runtime guard on its "
                "check steps) watch it: compiled with their hooks, its graph would break at "
                "every site for good"
            )
        self._sync_execution()

    # -- loop API ---------------------------------------------------------------------

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Call between backward and `optimizer.step()`: False when the runtime guard found
        a non-finite gradient (an FP8 overflow), in which case skip the step. The gradients
        have then been dropped (set to None), so an `optimizer.step()` made anyway changes
        nothing. The site at fault is demoted (at once on a guard-check step, else after the
        next step overflows too). Always True before the plan is applied or without a guard.
        """
        if self.guard is None or self.phase == "warmup":
            return True
        ok = self.guard.before_optimizer_step(optimizer)
        if not ok:
            self.skipped_steps += 1
        return ok

    def guard_optimizer(self, optimizer: torch.optim.Optimizer):
        """Run `before_optimizer_step` from `optimizer`'s step pre-hook, for loops that call
        `optimizer.step()` unconditionally (a skipped step then finds no gradient to apply).
        Not for closure-taking optimizers (LBFGS): their gradients come after the hook.
        Returns the hook's handle (`.remove()` undoes it)."""

        def pre_hook(opt, args, kwargs) -> None:
            self.before_optimizer_step(opt)

        return optimizer.register_step_pre_hook(pre_hook)

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Mark the end of a training step (after `optimizer.step()`). `loss`, if given, is
        checked for finiteness only on guard-check steps (no extra host sync)."""
        if self.phase == "closed":
            raise RuntimeError(
                "Session.step() after close(): the session was closed during its warm-up "
                "and will not plan; make a new Session to plan this model"
            )
        try:
            self._step(loss)
        finally:
            self._sync_execution()

    def _step(self, loss: Any) -> None:
        step = self.steps
        self.steps += 1
        if self.phase == "warmup":
            self.probe.step()
            if self.steps >= self.warmup_end and not self._probe_on_to_decide():
                self.plan_and_apply(self._pending_plan)
            return
        if self.phase == "verifying":
            # Before the guard, which arms its hooks on the modules the next step runs.
            self.verifier.step()
            if self.verifier.done:
                self._settle()
        if self.guard is not None:
            checking = self.guard._armed_step is not None
            # A compiled model's check steps run eagerly: none inside verification's timing.
            self.guard.periodic = not (self.compiled and self.phase == "verifying")
            events = self.guard.step(step)
            for event in events:
                what = event.site or "optimizer step"  # "": the step itself was skipped
                self._event(f"step {event.step}: {what} {event.action}: {event.reason}")
            demoted = any(e.action == "demoted" for e in events)
            if demoted and self.config.out_dir is not None and rank() == 0:
                # The saved plan stays the plan as it runs (the tables did not change).
                self.applied.record_demotions()
                self.plan.write(Path(self.config.out_dir) / "plan.parquet")
            if checking and loss is not None:
                value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
                if not math.isfinite(value):
                    self.nonfinite_losses += 1
                    self._event(f"step {step}: non-finite loss {value}")
        self._reprobe(step)

    def _probe_on_to_decide(self) -> bool:
        """At the warm-up's end, once (`decide_steps`): plan, and if undecided verdicts hold
        that plan back by more than `DECIDE_MIN_GAIN`, move the warm-up's end to about the
        step where Probe will have sampled enough batches to decide them, at most
        `decide_steps` later (True). Otherwise keep the plan for `plan_and_apply` (False).
        Every rank decides alike: they share the tables (merged) and the broadcast plan."""
        if self._decided:
            return False
        self._decided = True
        self.tables = self.probe.tables()  # a collective under torch.distributed
        plan = plan_once(self._make_plan)
        more = steps_to_decide(
            plan.summary, self.probe.config, self.steps, self.config.decide_limit
        )
        if more <= 0:
            self._pending_plan = plan
            return False
        stakes = plan.summary.undecided_stakes or {}
        gain = plan.summary.stakes_change()
        self.warmup_end = self.steps + more
        self._event(
            f"warm-up extended by {more} step(s) to step {self.warmup_end}: "
            f"{stakes.get('candidates')} undecided FP8 candidate(s) would change the plan "
            f"({gain}); about {stakes.get('batches')} sampled batches would decide most of them"
        )
        return True

    def plan_and_apply(self, plan: Plan | None = None) -> Plan:
        """End the warm-up now: tables, plan (rank 0, broadcast), apply, guard. `plan`: one
        already made from the tables as they stand (the warm-up's end)."""
        if self.phase == "closed":
            raise RuntimeError("plan_and_apply() after close(): the warm-up's Probe is detached")
        if self.phase != "warmup":
            raise RuntimeError(f"the plan was already applied (phase {self.phase!r})")
        if plan is None:
            self.tables = self.probe.tables()  # a collective under torch.distributed
        self.probe.detach()
        self.probe = None
        self._pending_plan = None
        self.plan = plan if plan is not None else plan_once(self._make_plan)
        self.applied = apply(self.model, self.plan, self.config.apply, sample=self.sample)
        self.phase = "applied"
        self._event(f"plan applied after {self.steps} step(s): {self.applied.summary()}")
        for line in self.plan.summary.lines():
            self._event(f"  {line}")
        if self.plan.summary.sites_fp8 == 0 and self.plan.summary.undecided:
            # Not a silent all-bf16 plan: in Lightning or HF nobody reads the events.
            warnings.warn(
                f"loka: the plan keeps every site in bf16 after a warm-up of {self.steps} "
                f"step(s): {self.plan.summary.undecided}",
                UndecidedPlanWarning,
                stacklevel=2,
            )
        if self.config.guard is not None:
            self.guard = RuntimeGuard(self.applied, self.config.guard)
            if not self.compiled:  # compiled: the first check comes at its schedule
                self.guard.arm(self.steps)
        if self.config.out_dir is not None and rank() == 0:
            self.save(self.config.out_dir)
        self._start_verifying()
        self._sync_execution()
        return self.plan

    def close(self) -> None:
        """Detach Probe and the guard's hooks; the model keeps its applied plan (all of it,
        when verification had not ended)."""
        if self.phase == "verifying":
            self.applied.use(s for s in self.applied.sites if s not in self.applied.demoted)
            self.phase = "applied"
            self._event(
                f"closed after {self.verifier.steps} verification step(s), before it ended: "
                "every applied site left in FP8, unverified"
            )
        if self.phase == "warmup":
            self.phase = "closed"  # nothing probed is left to plan from
        if self.probe is not None:
            self.probe.detach()
            self.probe = None
        if self.guard is not None:
            self.guard.disarm()
        self._sync_execution()

    def undo(self) -> None:
        """Close, and put the model's original modules back."""
        self.close()
        if self.applied is not None and not self.applied.undone:
            self.applied.undo()

    def save(self, directory: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the probe tables, kernel_bench, plan and HTML report into `directory`."""
        from loka.dispatch.report import write_report

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name in ("sites", "site_errors", "tensor_stats"):
            if name in self.tables:
                paths[name] = write_table(self.tables[name], directory / f"{name}.parquet", name)
        if self.kernel_bench is not None:
            paths["kernel_bench"] = write_table(
                self.kernel_bench, directory / "kernel_bench.parquet", "kernel_bench"
            )
        if self.applied is not None:
            self.applied.record_demotions()
        if self.plan is not None:
            paths["plan"] = self.plan.write(directory / "plan.parquet")
        if self.plan is not None and "sites" in self.tables:
            paths["report"] = write_report(
                directory / "report.html", sites=self.tables["sites"],
                site_errors=self.tables["site_errors"], plan=self.plan.table,
                kernel_bench=self.kernel_bench, summary=self.plan.summary,
            )  # fmt: skip
        return paths

    # -- internals --------------------------------------------------------------------

    def _resume(self, source: str | os.PathLike[str]) -> None:
        """Apply the plan an earlier Session saved (`SessionConfig.resume`), as it ran."""
        path = Path(source)
        path = path / "plan.parquet" if path.is_dir() else path

        def load() -> Plan:
            if not path.exists():
                raise FileNotFoundError(f"SessionConfig.resume: no plan at {path}")
            return read_plan(path)

        self.plan = plan_once(load)
        self.applied = apply(self.model, self.plan, self.config.apply, sample=self.sample)
        self.phase = "applied"
        self._verified_at = 0
        self._event(f"resumed from {path}: {self.applied.summary()}")
        if self.config.guard is not None:
            self.guard = RuntimeGuard(self.applied, self.config.guard)
            if not self.compiled:  # compiled: the first check comes at its schedule
                self.guard.arm(self.steps)

    def _start_verifying(self) -> None:
        config = self.config.verify
        live = [s for s in self.applied.sites if s not in self.applied.demoted]
        if config is None or not live:
            self._verified_at = self.steps
            return
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        if device.type == "cpu" and not config.on_cpu:
            self._event(
                "verification skipped: the model is on the CPU, where FP8 runs emulated and "
                "step time says nothing of the GPU the plan is for (VerifyConfig(on_cpu=True) "
                "verifies anyway)"
            )
            self._verified_at = self.steps
            return
        self.phase = "verifying"
        self._allow_recompiles(config)
        self.verifier = verifier_for(
            self.applied, config, self.timer, reduce=_max_over_ranks if is_distributed() else None,
            on_event=self._event, mode=self.config.plan.mode,
        )  # fmt: skip
        if self.verifier.done:
            self._settle()

    def _allow_recompiles(self, config: VerifyConfig) -> None:
        """A compiled model's verification compiles a variant per set (`allow_recompiles`)."""
        if self.compiled:
            allow_recompiles(config, self._event)

    def _settle(self) -> None:
        settle(self.applied, self.verifier.result)
        self.phase = "applied"
        self._verified_at = self.steps
        self._event(f"verified after {self.steps} step(s): {self.applied.summary()}")
        if self.config.out_dir is not None and rank() == 0:
            self.save(self.config.out_dir)  # the plan's summary now holds the measurement

    def _sync_execution(self) -> None:
        """A compiled model runs eagerly exactly while hooks watch it (`eager_switch`)."""
        if self._switch is not None:
            watched = self.probe is not None or (self.guard is not None and self.guard.armed)
            self._switch.set(watched)

    def _event(self, text: str) -> None:
        self.events.append(text)
        log.info("loka: %s", text)
        if self.on_event is not None:
            self.on_event(text)

    def _probe_config(self):
        if self.config.probe is not None:
            return self.config.probe
        return warmup_probe_config(self.config.warmup_steps)

    def _attach_probe(self):
        if self._switch is not None:
            self._switch.set(True)  # eager before Probe's hooks go on (eager_switch)
        return _probe_module().Probe(self.model, self._probe_config())

    def _make_plan(self) -> Plan:
        # The tables say everything the plan needs, the norm feeding each site included
        # (Probe traced it): the model is not traced again.
        sites, errors = self.tables["sites"], self.tables["site_errors"]
        if self.kernel_bench is None:
            # Timed once: a warm-up extended to decide verdicts plans again from the same
            # timings (the sites and their shapes are the same model's).
            self.kernel_bench = self._kernel_bench(sites, errors)
        return make_plan(sites, errors, self.kernel_bench, self.config.plan,
                         gemm_share=self.config.gemm_share)  # fmt: skip

    def _kernel_bench(self, sites: pl.DataFrame, errors: pl.DataFrame) -> pl.DataFrame:
        given = self.config.kernel_bench
        if isinstance(given, pl.DataFrame):
            return given
        if given is not None:
            return read_table(given, "kernel_bench")
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        mode = self.config.plan.mode
        # Fusing a norm is an eager-mode candidate only (compiled graphs fuse it themselves).
        norm_shapes = site_norm_shapes(sites) if mode == "eager" else []
        # What the compiled graph fuses the inputs' quantizations into.
        producer_shapes = site_producer_shapes(sites) if mode != "eager" else []
        result = benchmark(
            site_shapes(sites), device=device, cache=BenchCache(self.config.cache_dir),
            cost_model=CostModel.shipped(), budget_s=self.config.bench_budget_s,
            norm_shapes=norm_shapes, producer_shapes=producer_shapes,
            backends=mode_backends(mode), recipes=site_recipes(errors),
            charge_host=mode == "eager" and self.config.plan.charge_host,
        )  # fmt: skip
        for note in result.notes:
            self._event(f"bench: {note}")
        return result.table

    def _reprobe(self, step: int) -> None:
        every = self.config.reprobe_every
        if every is None or self.applied is None or self.phase != "applied":
            return
        since = self.steps - self._verified_at
        if self.probe is None and since > 0 and since % every == 0:
            self.probe = self._attach_probe()
            self._reprobe_start = self.steps
            self._event(f"step {step}: re-probing for {self.config.reprobe_steps} step(s)")
            return
        if self.probe is not None:
            self.probe.step()
            if self.steps - self._reprobe_start >= self.config.reprobe_steps:
                tables = self.probe.tables()
                self.probe.detach()
                self.probe = None
                if self.guard is not None:
                    for event in self.guard.check_errors(tables["site_errors"], step):
                        self._event(
                            f"step {event.step}: {event.site} {event.action}: {event.reason}"
                        )
