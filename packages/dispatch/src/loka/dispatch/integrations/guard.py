"""The runtime guard: watches the FP8 sites of an applied plan and demotes a site to bf16
when it produces non-finite values from finite inputs (an FP8 overflow or a NaN), or when a
re-probe finds its error drifted past the budget. Every demotion is logged with its reason.

Checks run on one step in `check_every`: hooks are armed for that step only, flags are
accumulated on the device, and read back with a single host sync at the step's end.

An overflow must not reach the weights, so the guard also has a word before the optimizer
step (`before_optimizer_step`, between backward and `optimizer.step()`): when a gradient is
non-finite it drops every gradient, so that the step changes nothing (as
`torch.amp.GradScaler` skips such a step), judges the sites if the step was armed (and
demotes the culprit), and otherwise arms the next step to find it. That check reads one flag
per step (one host sync, like GradScaler's).
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
from loka.mods.sharding import local_tensor

log = logging.getLogger("loka.dispatch")


@dataclass(frozen=True)
class GuardConfig:
    """check_every: steps between checks (each costs one host sync).
    drift_factor: after a re-probe, demote a site whose error bound exceeds its budget times
    this factor (1.0: as soon as the verdict turns unsafe).
    skip_nonfinite: `before_optimizer_step` checks the gradients of every step and skips a
    step whose gradients are non-finite (False: it only judges armed steps)."""

    check_every: int = 50
    drift_factor: float = 1.0
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        if self.check_every < 1:
            raise ValueError(f"GuardConfig.check_every must be >= 1, got {self.check_every}")
        if not self.drift_factor >= 1.0:
            raise ValueError(f"GuardConfig.drift_factor must be >= 1, got {self.drift_factor}")


@dataclass(frozen=True)
class GuardEvent:
    step: int
    site: str
    action: str  # "demoted", "observed", or "skipped" (site "": an optimizer step)
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
        """All flags of `sites` and the step's own (site "") in one host sync; under
        torch.distributed a flag raised on any rank is raised on all, so that every rank
        demotes the same sites and skips the same steps."""
        keys = [(s, w) for s in sites for w in _WHAT] + [k for k in self.values if k[0] == ""]
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
    # A DTensor (an FSDP2 gradient shard) is checked on this rank's shard: `read` raises a
    # flag on every rank when any rank raised it.
    return ~torch.isfinite(local_tensor(t)).all()


def _any_nonfinite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flags = [bad.to(device) for t in tensors if (bad := _nonfinite(t)) is not None]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any()


class RuntimeGuard:
    """Guards the FP8 sites of `applied`. Per training step: `before_optimizer_step(optimizer)`
    between backward and the optimizer step (skip the step when it returns False), then
    `step(step)` after it; `check_errors(site_errors, step)` after a re-probe."""

    def __init__(self, applied: Applied, config: GuardConfig | None = None) -> None:
        self.applied = applied
        self.config = config or GuardConfig()
        self.events: list[GuardEvent] = []
        self.skipped_steps = 0
        self._handles: list = []
        self._flags: _Flags | None = None
        self._armed_step: int | None = None
        self._current = 0  # the step under way (the one after the last `step()`)
        self._judged: list[GuardEvent] | None = None  # an armed step judged before its update
        self._arm_next = False  # a skipped, unwatched step: watch the next one
        # Checks every `check_every` steps (False: only the step after an overflow; a
        # Session turns them off while it times a compiled model's variants).
        self.periodic = True

    def _sites(self) -> dict[str, nn.Module]:
        live = [s for s in self.applied.sites if s not in self.applied.demoted]
        return {s: self.applied.model.get_submodule(s) for s in live}

    def _device(self) -> torch.device:
        return next((p.device for p in self.applied.model.parameters()), torch.device("cpu"))

    def arm(self, step: int) -> None:
        """Watch every live FP8 site during the coming step."""
        self.disarm()
        flags = self._flags = _Flags()
        self._armed_step = self._current = step
        self._judged = None
        # The gradients are watched through tensor hooks, not a full backward hook: that one
        # warns on every backward of a site whose input needs no gradient (the first layer).
        for name, module in self._sites().items():

            def watch(tensor: torch.Tensor, what: str, name: str) -> None:
                def hook(grad: torch.Tensor) -> None:
                    if (bad := _nonfinite(grad)) is not None:
                        flags.mark(name, what, bad)

                tensor.register_hook(hook)

            def pre_hook(module, args, name=name):
                x = args[0] if args else None
                if not (isinstance(x, torch.Tensor) and x.requires_grad):
                    return None
                # A view of its own: its gradient is this site's dgrad alone, not the sum
                # over every consumer of x.
                x = x.view_as(x)
                watch(x, "grad_input", name)
                return (x, *args[1:])

            def forward_hook(module, args, out, name=name) -> None:
                if (bad := _nonfinite(args[0] if args else None)) is not None:
                    flags.mark(name, "input", bad)
                if (bad := _nonfinite(out)) is not None:
                    flags.mark(name, "output", bad)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    watch(out, "grad_output", name)

            self._handles.append(module.register_forward_pre_hook(pre_hook))
            self._handles.append(module.register_forward_hook(forward_hook))

    @property
    def armed(self) -> bool:
        """Whether the sites' hooks are in place (a check step is under way)."""
        return bool(self._handles)

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Between backward and the optimizer step of the step under way. Returns False when
        a gradient is non-finite; every gradient of the model (and of `optimizer`'s
        parameters) is then set to None, so that an `optimizer.step()` call changes neither
        the weights nor the optimizer's state (torch's optimizers pass over parameters
        without a gradient): skipping the call or making it are both safe. An armed step is
        judged here, where its weight gradients are still at hand; an unarmed step that
        overflowed arms the next one, which finds the site if the overflow recurs."""
        armed = self._flags is not None and self._judged is None
        if not armed and not self.config.skip_nonfinite:
            return True
        params = {id(p): p for p in self.applied.model.parameters()}
        for group in getattr(optimizer, "param_groups", None) or []:  # accelerate's too
            params.update((id(p), p) for p in group["params"])
        device = self._device()
        flags = self._flags if armed else _Flags()
        if self.config.skip_nonfinite:
            grads = [p.grad for p in params.values() if p.grad is not None]
            flags.mark("", "grads", _any_nonfinite(grads, device))
        step = self._current
        new, read = self._evaluate(flags, step)
        if armed:
            self._judged = new
        if not read.get(("", "grads"), False):
            self.events += new
            return True
        for p in params.values():
            p.grad = None
        self.skipped_steps += 1
        culprits = [e.site for e in new if e.action == "demoted"]
        if culprits:
            reason = f"non-finite gradients (FP8 overflow in {', '.join(culprits)})"
        elif armed:
            reason = "non-finite gradients from upstream of the FP8 sites"
        else:
            reason = "non-finite gradients (the sites are watched on the next step)"
            self._arm_next = True
        reason += "; weights unchanged"
        log.warning("loka guard: step %d: optimizer step skipped: %s", step, reason)
        new.append(GuardEvent(step, "", "skipped", reason))
        if not armed:
            self._judged = new  # reported by `step()`
        self.events += new
        return False

    def step(self, step: int) -> list[GuardEvent]:
        """End of training step `step`: evaluate an armed check (unless
        `before_optimizer_step` did), demote culprits, and arm the next check when it is
        due. Returns the events of this step, `before_optimizer_step`'s included."""
        new: list[GuardEvent] = []
        if self._judged is not None:
            new = self._judged
        elif self._flags is not None and self._armed_step is not None:
            new, _ = self._evaluate(self._flags, self._armed_step)
            self.events += new
        self.disarm()
        self._flags = self._armed_step = self._judged = None
        self._current = step + 1
        due = self.periodic and (step + 1) % self.config.check_every == 0
        if due or self._arm_next:
            self._arm_next = False
            self.arm(step + 1)
        return new

    def _evaluate(self, flags: _Flags, step: int) -> tuple[list[GuardEvent], dict]:
        """Read `flags` (one host sync); judge every live site by them if they are the armed
        step's. Returns the events and the flags read."""
        self.disarm()
        sites = self._sites()
        if flags is self._flags:
            for name, module in sites.items():
                grad = getattr(getattr(module, "weight", None), "grad", None)
                if (bad := _nonfinite(grad)) is not None:
                    flags.mark(name, "weight_grad", bad)
        else:
            sites = {}
        read = flags.read(list(sites), self._device())
        new: list[GuardEvent] = []
        for name in sites:
            new += self._judge(name, read, step)
        return new, read

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
