"""The runtime guard: watches the FP8 sites of an applied plan and demotes a site to bf16
when it produces non-finite values from finite inputs (an FP8 overflow or a NaN), or when a
re-probe finds its error drifted past the budget. Every demotion is logged with its reason.

Checks run on one step in `check_every`: hooks are armed for that step only, flags are
accumulated on the device, and read back with a single host sync at the step's end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl
import torch
import torch.distributed as dist
from torch import nn

from loka.dispatch.apply_plan import Applied
from loka.dispatch.integrations.distributed import is_distributed

log = logging.getLogger("loka.dispatch")


@dataclass(frozen=True)
class GuardConfig:
    """check_every: steps between checks (each costs one host sync).
    drift_factor: after a re-probe, demote a site whose error bound exceeds its budget times
    this factor (1.0: as soon as the verdict turns unsafe)."""

    check_every: int = 50
    drift_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.check_every < 1:
            raise ValueError(f"GuardConfig.check_every must be >= 1, got {self.check_every}")
        if not self.drift_factor >= 1.0:
            raise ValueError(f"GuardConfig.drift_factor must be >= 1, got {self.drift_factor}")


@dataclass(frozen=True)
class GuardEvent:
    step: int
    site: str
    action: str  # "demoted" or "observed"
    reason: str


_WHAT = ("input", "output", "grad_output", "grad_input", "weight_grad")


class _Flags:
    """Device-side booleans per site, filled by hooks on an armed step."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], torch.Tensor] = {}

    def mark(self, site: str, what: str, bad: torch.Tensor) -> None:
        key = (site, what)
        self.values[key] = self.values[key] | bad if key in self.values else bad

    def read(self, sites: list[str], device: torch.device) -> dict[tuple[str, str], bool]:
        """All flags of `sites` (one host sync); under torch.distributed a flag raised on any
        rank is raised on all, so that every rank demotes the same sites."""
        keys = [(s, w) for s in sites for w in _WHAT]
        if not keys:
            return {}
        zero = torch.zeros((), dtype=torch.bool, device=device)
        stacked = torch.stack([self.values.get(k, zero).reshape(()).to(device) for k in keys])
        stacked = stacked.to(torch.int32)
        if is_distributed():
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        return dict(zip(keys, map(bool, stacked.cpu().tolist()), strict=True))


def _nonfinite(t: torch.Tensor | None) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    return ~torch.isfinite(t).all()


class RuntimeGuard:
    """Guards the FP8 sites of `applied`. Call `step(step)` once per training step (after the
    optimizer step); `check_errors(site_errors, step)` after a re-probe."""

    def __init__(self, applied: Applied, config: GuardConfig | None = None) -> None:
        self.applied = applied
        self.config = config or GuardConfig()
        self.events: list[GuardEvent] = []
        self._handles: list = []
        self._flags: _Flags | None = None
        self._armed_step: int | None = None

    def _sites(self) -> dict[str, nn.Module]:
        live = [s for s in self.applied.sites if s not in self.applied.demoted]
        return {s: self.applied.model.get_submodule(s) for s in live}

    def arm(self, step: int) -> None:
        """Watch every live FP8 site during the coming step."""
        self.disarm()
        flags = self._flags = _Flags()
        self._armed_step = step
        for name, module in self._sites().items():

            def forward_hook(module, args, out, name=name) -> None:
                if (bad := _nonfinite(args[0] if args else None)) is not None:
                    flags.mark(name, "input", bad)
                if (bad := _nonfinite(out)) is not None:
                    flags.mark(name, "output", bad)

            def backward_hook(module, grad_input, grad_output, name=name) -> None:
                if (bad := _nonfinite(grad_output[0])) is not None:
                    flags.mark(name, "grad_output", bad)
                if (bad := _nonfinite(grad_input[0])) is not None:
                    flags.mark(name, "grad_input", bad)

            self._handles.append(module.register_forward_hook(forward_hook))
            self._handles.append(module.register_full_backward_hook(backward_hook))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def step(self, step: int) -> list[GuardEvent]:
        """End of training step `step`: evaluate an armed check, demote culprits, and arm the
        next check when it is due. Returns the events of this step."""
        new: list[GuardEvent] = []
        if self._flags is not None and self._armed_step is not None:
            self.disarm()
            sites = self._sites()
            for name, module in sites.items():
                grad = getattr(getattr(module, "weight", None), "grad", None)
                if (bad := _nonfinite(grad)) is not None:
                    self._flags.mark(name, "weight_grad", bad)
            device = next((p.device for p in self.applied.model.parameters()), torch.device("cpu"))
            flags = self._flags.read(list(sites), device)
            for name in sites:
                new += self._judge(name, flags, self._armed_step)
            self._flags = None
            self._armed_step = None
        if (step + 1) % self.config.check_every == 0:
            self.arm(step + 1)
        self.events += new
        return new

    def _judge(self, name: str, flags: dict, step: int) -> list[GuardEvent]:
        def f(what: str) -> bool:
            return flags.get((name, what), False)

        reason = None
        if f("output") and not f("input"):
            reason = "forward produced non-finite values from finite inputs (FP8 overflow/NaN)"
        elif f("grad_input") and not f("grad_output"):
            reason = "dgrad produced non-finite values from a finite output gradient"
        elif f("weight_grad") and not f("grad_output") and not f("input"):
            reason = "wgrad produced a non-finite weight gradient from finite operands"
        if reason is not None:
            self.applied.demote(name, f"step {step}: {reason}")
            return [GuardEvent(step, name, "demoted", reason)]
        if f("input") or f("grad_output"):
            what = "input" if f("input") else "output gradient"
            log.warning(
                "loka guard: step %d: non-finite %s reached %s (upstream)", step, what, name
            )
            return [GuardEvent(step, name, "observed", f"non-finite {what} from upstream")]
        return []

    def check_errors(self, site_errors: pl.DataFrame, step: int) -> list[GuardEvent]:
        """Demote applied sites whose re-probed error for the recipe they run drifted past
        budget x drift_factor."""
        plan = self.applied.plan.table
        running = {
            (r["site"], r["pass"]): r["recipe"]
            for r in plan.iter_rows(named=True)
            if r["recipe"] != "bf16"
        }
        new = []
        for r in site_errors.iter_rows(named=True):
            site = r["site"]
            if running.get((site, r["pass"])) != r["recipe"] or site in self.applied.demoted:
                continue
            if site not in self.applied.sites:
                continue
            bound = r["ucb_rel_err"] if r["ucb_rel_err"] is not None else r["mean_rel_err"]
            limit = r["budget"] * self.config.drift_factor
            if r["verdict"] == "unsafe" and bound > limit:
                reason = (
                    f"error drift: {r['pass']} {r['recipe']} error bound {bound:.4g} > "
                    f"{limit:.4g} (re-probed at step {step})"
                )
                self.applied.demote(site, f"step {step}: {reason}")
                new.append(GuardEvent(step, site, "demoted", reason))
        self.events += new
        return new
