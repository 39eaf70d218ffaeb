"""`apply(model, plan)` (module `apply_plan`, so that the name `loka.dispatch.apply` stays the
function): put a plan's FP8 passes into a live model, through `loka.mods`.

Everything is checked before anything changes: the plan's schema version (when read from
a file), that its sites are this model's (names, in/out features, the model fingerprint
recorded with the plan), that each planned backend can run on the model's device. A site
that does not match falls back to bf16 with a warning, or, with ``strict=True``, the call
fails naming every problem; a plan that matches almost nothing of the model is refused in
either mode. The plan's rows become typed `loka.mods` site mods once
(`loka.mods.spec.site_mods_from_plan`); the swap itself is `loka.mods.apply`, which is all
or nothing and names the sites it refuses, so that those fall back to bf16 and the rest is
applied. Nothing is traced: the norm a site fuses is the plan's `norm` (Probe's
`sites.norm`). `Applied.undo` restores the original modules (holding the same, possibly
trained, Parameters).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import torch
from torch import nn

from loka.dispatch.planner import Plan, PlanSummary, sites_fingerprint
from loka.kernels import registry
from loka.mods.apply import ModsError
from loka.mods.apply import apply as mods_apply
from loka.mods.config import PassConfig
from loka.mods.fp8_linear import Fp8Linear, prequantize_weights, release_prequantized_weights
from loka.mods.sharding import base_class, fsdp_managed
from loka.mods.spec import ModSpec, SiteMods, site_mods_from_plan
from loka.schema import validate

__all__ = [
    "Applied",
    "ApplyConfig",
    "PlanFallbackWarning",
    "PlanMismatchError",
    "apply",
]

log = logging.getLogger("loka.dispatch")
DEMOTED_KEY = "demoted"  # plan metadata: what a run demoted (`Applied.record_demotions`)


class PlanMismatchError(ValueError):
    """The plan does not fit this model (or device); nothing was applied."""


class PlanFallbackWarning(UserWarning):
    """A planned site or backend was left out (bf16 kept, or another backend used)."""


@dataclass(frozen=True)
class ApplyConfig:
    """How `apply` treats the plan.

    strict: any mismatch raises `PlanMismatchError` (else: that site stays bf16, warned).
    module_filter_fn: ``fn(module, name) -> bool``; sites it rejects stay bf16.
    fuse_norm: also fuse the norm that feeds each FP8 site alone (the plan's `norm` column)
        when its forward recipe runs on the fused kernel; needs `sample`, on which the fused
        model is checked against the original.
    replace_unrunnable_backends: a planned backend that cannot run on the model's device
        (e.g. a GPU-only backend on the CPU) is replaced by the default backend of the same
        recipe (identical numerics; speed not what was planned); False: the site stays bf16.
    emulate_on_cpu: on the CPU, where Triton kernels only run in its interpreter (seconds
        per launch), a site whose FP8 passes ``torch.native`` can all run (tensor or row
        scales, dynamic scaling, no fused norm) runs them on ``torch.native.cpu``, at any shape:
        the same quantization bit for bit, the GEMM emulated in float32 (as torchao's
        ``emulate=True``). Other sites (block scales, delayed scaling) keep the planned or
        replacement backend. False: always the planned backends.
    prequantize_weights: quantize the weight of every FP8 site on ``torch.native`` once, for
        serving (`loka.mods.Fp8Linear.prequantize_weight`): forwards without gradients then
        quantize only their input, with no inductor freezing needed. None (default): for an
        inference plan (`PlanConfig(inference=True)`). A forward that would train such a
        weight raises until `Applied.release_prequantized()` is called.
    bias_grad: how every FP8 site's backward takes its bias gradient
        (`loka.mods.bias_grad`: "sum", "gemm", "split"); None: the config's default ("sum").
    eager_graphs: in eager mode on a GPU, the FP8 sites' quantizations replay from CUDA
        graphs (`loka.mods.Fp8LinearConfig.eager_graphs`, `loka.mods.eager_graphs`); False
        runs them op by op and holds no graph memory.
    """

    strict: bool = False
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None
    fuse_norm: bool = False
    replace_unrunnable_backends: bool = True
    emulate_on_cpu: bool = True
    prequantize_weights: bool | None = None
    bias_grad: str | None = None
    eager_graphs: bool = True


@dataclass
class Applied:
    """What `apply` did: the sites now in FP8, those kept in bf16 and why, and the mods
    report that can undo it."""

    model: nn.Module = field(repr=False)
    plan: Plan = field(repr=False)
    sites: list[str]
    fallbacks: dict[str, str]
    report: Any = field(repr=False)  # loka.mods Report
    demoted: dict[str, str] = field(default_factory=dict)
    undone: bool = False
    # Sites whose FP8 passes run on torch.native, emulated on the CPU (ApplyConfig.emulate_on_cpu).
    emulated: list[str] = field(default_factory=list)
    # Per FP8 site, every module path apply swapped for it (the site, and the norm of a
    # fused site): (path, planned module, original module). What `use` switches between.
    variants: dict[str, list[tuple[str, nn.Module, nn.Module]]] = field(
        default_factory=dict, repr=False
    )
    # FP8 passes run in bf16 from now on, while the rest of their site stays FP8
    # ("site/pass" -> why; `demote_pass`, verification with VerifyConfig(unit="pass")).
    demoted_passes: dict[str, str] = field(default_factory=dict)
    # FP8 sites whose weight was quantized once for serving (ApplyConfig.prequantize_weights).
    prequantized: list[str] = field(default_factory=list)
    # The planned config of each site's FP8 linears, before any pass was switched off.
    _planned_configs: dict[int, Any] = field(default_factory=dict, repr=False)
    # The config an in-place site ran with before `use` switched it to bf16 (`_switch`).
    _parked: dict[int, Any] = field(default_factory=dict, repr=False)

    def undo(self) -> None:
        """Restore the model's original modules (the Parameters are the same objects)."""
        if self.undone:
            raise RuntimeError("this apply was already undone")
        if self.report is not None:
            self.report.undo()
        self.undone = True

    def record_demotions(self) -> None:
        """Write the sites and passes demoted since `apply` (verification's and the runtime
        guard's, with their reasons) into the plan's metadata, so that a saved plan is the
        plan as it runs: `apply` of that plan demotes them again (a resumed run)."""
        self.plan.metadata[DEMOTED_KEY] = json.dumps(
            {"sites": self.demoted, "passes": self.demoted_passes}, sort_keys=True
        )

    def release_prequantized(self) -> list[str]:
        """Drop the serving copies of the weights (`prequantized`), so that the model can
        train again; the sites that had one."""
        released = sorted(set(release_prequantized_weights(self.model)) & set(self.prequantized))
        self.prequantized = []
        return released

    def calibrate_input_scales(
        self,
        batches: Iterable[Any],
        *,
        margin: float = 2.0,
        forward: Callable[[nn.Module, Any], Any] | None = None,
    ) -> dict[str, float]:
        """Serving: fix the input scale of every prequantized FP8 site at the largest |input|
        `forward(model, batch)` (default ``model(batch)``) gives it over `batches`, times
        `margin` (`loka.mods.static_scales.calibrate_input_scales`: all or nothing; call it
        under the autocast the model serves with). The served forward then casts its inputs
        with no amax reduction: DHEN xl served 1.135x -> 1.306x bf16 at B = 16384, Wukong xl
        1.26x -> 1.33x at 65536, with the same output error against bf16. An input beyond
        the calibrated range saturates; `release_prequantized` drops the scales."""
        from loka.mods.static_scales import calibrate_input_scales

        if self.undone:
            raise RuntimeError("this apply was undone")
        if not self.prequantized:
            raise ValueError(
                "no prequantized FP8 site to calibrate: static input scales are for serving "
                "(apply an inference plan, or ApplyConfig(prequantize_weights=True))"
            )
        return calibrate_input_scales(self.model, batches, margin=margin, forward=forward)

    def use(self, active: Iterable[str]) -> None:
        """Switch the live FP8 sites in place: those in `active` run their planned module,
        every other one the model's original bf16 module(s) (the nn.Linear, and the norm of a
        fused site), holding the same Parameters. Demoted sites are left alone."""
        if self.undone:
            raise RuntimeError("this apply was undone")
        active = set(active)
        if unknown := active - set(self.sites):
            raise ValueError(f"not FP8 sites of this plan: {sorted(unknown)}")
        for site in self.sites:
            if site in self.demoted:
                continue
            if site not in self.variants:
                raise RuntimeError(f"{site}: its original modules were not recorded")
            self._switch(site, site in active)

    def _switch(self, site: str, on: bool) -> None:
        """Put `site`'s planned module(s) in the model (`on`) or its original one(s). A linear
        that FSDP2 manages (`loka.mods.sharding`: converted in place, or sharded since) stays:
        it switches by its config, bf16 being exactly the original nn.Linear's forward."""
        from loka.mods.config import Fp8LinearConfig

        for path, planned, original in self.variants[site]:
            if _by_config(planned, original):
                # Off parks the config it ran with (pass switches included), as a swapped-out
                # planned module keeps its own; on restores it.
                self._planned_configs.setdefault(id(planned), planned.fp8_config)
                if on and id(planned) in self._parked:
                    planned.set_config(self._parked.pop(id(planned)))
                elif not on and not planned.plan.all_high_precision:
                    self._parked[id(planned)] = planned.fp8_config
                    planned.set_config(Fp8LinearConfig.bf16())
            else:
                _set_module(self.model, path, planned if on else original)

    def pass_units(self) -> list[str]:
        """The live FP8 passes as ``"site/pass"`` units, for the sites whose planned modules
        are FP8 linears (their passes switch one by one); any other live site is one unit."""
        units: list[str] = []
        for site in self.sites:
            if site in self.demoted:
                continue
            passes = self._fp8_passes(site)
            units += [f"{site}/{p}" for p in passes] if passes is not None else [site]
        return units

    def use_units(self, active: Iterable[str]) -> None:
        """`use` per unit (`pass_units`): a site runs its planned module(s) with only its
        passes in `active` in FP8 (the others in bf16), its original module(s) when none
        is; a site-level unit switches as in `use`."""
        active = set(active)
        if unknown := active - set(self.pass_units()):
            raise ValueError(f"not live FP8 units of this plan: {sorted(unknown)}")
        on: dict[str, set[str]] = {}
        for unit in active:
            site, _, pass_ = unit.rpartition("/") if "/" in unit else (unit, "", "")
            on.setdefault(site, set()).update([pass_] if pass_ else [])
        self.use(on)
        for site, passes in on.items():
            if self._fp8_passes(site) is not None:
                self._set_passes(site, passes)

    def demote_pass(self, site: str, pass_: str, reason: str) -> bool:
        """Run one FP8 pass of `site` in bf16 from now on (the site's other FP8 passes
        stay); the whole site is demoted when it was its last one. False if it already was."""
        passes = self._fp8_passes(site)
        if site in self.demoted or passes is None or pass_ not in passes:
            return False
        self.demoted_passes[f"{site}/{pass_}"] = reason
        log.warning("loka: %s/%s demoted to bf16: %s", site, pass_, reason)
        if passes == [pass_]:
            return self.demote(site, f"every FP8 pass demoted: {reason}")
        if site in self.active:
            self._set_passes(site, set(passes) - {pass_})
        return True

    def _release_serving_copy(self, site: str) -> None:
        """A demoted site serves bf16 from now on: its prequantized FP8 weight (half the bf16
        weight's bytes, held by the planned module that `variants` keeps for `use`) is
        dropped, and the site leaves `prequantized`."""
        if site not in self.prequantized:
            return
        modules = [m for _, m, _ in self.variants.get(site, [])]
        if site not in self.variants:
            modules.append(self.model.get_submodule(site))
        for module in modules:
            if isinstance(module, Fp8Linear) and module.prequantized:
                module.release_prequantized_weight()
        self.prequantized = [s for s in self.prequantized if s != site]

    def _fp8_linears(self, site: str) -> list[nn.Module]:
        return [m for _, m, _ in self.variants.get(site, []) if isinstance(m, Fp8Linear)]

    def _fp8_passes(self, site: str) -> list[str] | None:
        """The FP8 passes still planned at `site` (None: it does not switch per pass)."""
        linears = self._fp8_linears(site)
        if len(linears) != 1:
            return None
        config = self._planned_configs.setdefault(id(linears[0]), linears[0].fp8_config)
        return [
            p for p, c in config.passes().items()
            if not c.is_bf16 and f"{site}/{p}" not in self.demoted_passes
        ]  # fmt: skip

    def _set_passes(self, site: str, passes: set[str]) -> None:
        (linear,) = self._fp8_linears(site)
        planned = self._planned_configs[id(linear)]
        wanted = planned.replace(**{
            p: c if p in passes and f"{site}/{p}" not in self.demoted_passes else PassConfig()
            for p, c in planned.passes().items()
        })  # fmt: skip
        if linear.fp8_config != wanted:
            linear.set_config(wanted)

    @property
    def active(self) -> list[str]:
        """The live sites whose planned FP8 module is in the model now."""
        return [
            s for s in self.sites
            if s not in self.demoted and s in self.variants
            and self.model.get_submodule(s) is self.variants[s][0][1]
            and not _switched_off_in_place(self.variants[s][0])
        ]  # fmt: skip

    def demote(self, site: str, reason: str) -> bool:
        """Run `site` in bf16 from now on (the runtime guard's action); False if it already
        was. The model's original module(s) go back (same Parameters); `undo` still works."""
        if site in self.demoted or site not in self.sites:
            return False
        if site in self.variants and not self.undone:
            self._switch(site, False)
            self._release_serving_copy(site)
            self.demoted[site] = reason
            log.warning("loka: site %s demoted to bf16: %s", site, reason)
            return True
        from loka.mods.config import Fp8LinearConfig

        module = self.model.get_submodule(site)
        if type(module) is Fp8Linear:
            parent_name, _, child = site.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, module.to_linear())
        elif isinstance(module, Fp8Linear):  # a fused norm+linear: keep the fusion, drop FP8
            module.set_config(Fp8LinearConfig.bf16())
        else:
            return False
        self._release_serving_copy(site)
        self.demoted[site] = reason
        log.warning("loka: site %s demoted to bf16: %s", site, reason)
        return True

    def summary(self) -> str:
        text = f"{len(self.sites)} site(s) in FP8"
        if self.emulated:
            text += f" ({len(self.emulated)} emulated on the CPU by torch.native)"
        if self.fallbacks:
            text += f", {len(self.fallbacks)} kept in bf16"
        if self.demoted:
            text += f", {len(self.demoted)} demoted since"
        if self.prequantized:
            text += f", {len(self.prequantized)} with the weight prequantized for serving"
        return text


def _recorded_demotions(plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """(sites, passes) the plan's metadata records as demoted by the run that saved it
    (`Applied.record_demotions`); read before the model is touched."""
    text = plan.metadata.get(DEMOTED_KEY)
    if not text:
        return {}, {}
    try:
        recorded = json.loads(text)
        return dict(recorded["sites"]), dict(recorded["passes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PlanMismatchError(
            f"the plan's recorded demotions are unreadable ({type(exc).__name__}: {exc})"
        ) from None


def _demote_as_recorded(applied: Applied, sites: dict[str, str], passes: dict[str, str]) -> None:
    """Demote again what the run that saved the plan had demoted, with its reasons."""
    for site, reason in sites.items():
        if site in applied.sites:
            applied.demote(site, str(reason))
    for unit, reason in passes.items():
        site, _, pass_ = unit.rpartition("/")
        if site in applied.sites and site not in applied.demoted:
            applied.demote_pass(site, pass_, str(reason))


def _by_config(planned: nn.Module, original: nn.Module) -> bool:
    """Whether a site's module switches to bf16 by its config rather than by a swap: it was
    converted in place, or FSDP2 manages it since (sharded after `apply`), filling it."""
    return planned is original or (isinstance(planned, Fp8Linear) and fsdp_managed(planned))


def _switched_off_in_place(variant: tuple[str, nn.Module, nn.Module]) -> bool:
    """Whether a site's module, switched by its config, runs its bf16 forward now."""
    _, planned, original = variant
    return _by_config(planned, original) and planned.plan.all_high_precision


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(parent, child) is not module:
        setattr(parent, child, module)


def _variants(
    before: dict[str, nn.Module], model: nn.Module, sites: set[str]
) -> dict[str, list[tuple[str, nn.Module, nn.Module]]]:
    """The swaps `loka.mods.apply` made, per site: a site's own path, and the path of the
    norm its fused module holds (`NormLinear.norm`)."""
    after = dict(model.named_modules())
    changed = {p: m for p, m in after.items() if p in before and before[p] is not m}
    out: dict[str, list[tuple[str, nn.Module, nn.Module]]] = {}
    for site in sites:
        if site not in changed:
            if base_class(after.get(site)) is Fp8Linear:  # converted in place (FSDP2)
                out[site] = [(site, after[site], after[site])]
            continue
        module = changed[site]
        out[site] = [(site, module, before[site])]
        norm = getattr(module, "norm", None)
        out[site] += [
            (p, m, before[p]) for p, m in changed.items() if norm is not None and m is norm
        ]
    return out


def _as_plan(plan: Plan | pl.DataFrame | str | os.PathLike[str]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, pl.DataFrame):
        table = validate(plan, "plan")
        summary = PlanSummary(0, 0, 0, 1.0, 1.0, None, None, None, False, "unknown")
        return Plan(table, summary, {})
    from loka.dispatch.tables import read_plan

    return read_plan(plan)


def _model_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _linear_sites(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _check_site(
    name: str, rows: list[dict], linears: dict[str, nn.Linear], planned: dict
) -> str | None:
    module = linears.get(name)
    if module is None:
        return f"{name!r}: no nn.Linear of that name in the model"
    if base_class(module) is not nn.Linear:
        return f"{name!r} is a {type(module).__name__} (already converted?), not an nn.Linear"
    K, N = rows[0]["K"], rows[0]["N"]
    if (module.in_features, module.out_features) != (K, N):
        return (
            f"{name!r}: the plan was made for K={K}, N={N}; the module has "
            f"in_features={module.in_features}, out_features={module.out_features}"
        )
    if name in planned and tuple(planned[name]) != (K, N):
        return f"{name!r}: the plan's rows and its metadata disagree on K, N"
    return None


def _runnable_backend(
    pass_config: PassConfig, device: torch.device, K: int, N: int, pass_: str, replace: bool
) -> tuple[str | None, str | None]:
    """(backend to use, note) for one FP8 pass on `device`; (None, reason) when none runs."""
    backend = pass_config.backend
    reason = registry.get(backend).runnable_reason(device)
    if reason is None:
        return backend, None
    if not replace:
        return None, reason
    for other in registry.backends("mm"):
        if other.name.endswith(".fast") or other.runs_bf16:
            continue
        if (
            other.runnable_reason(device) is None
            and other.supports(pass_config.recipe, 128, K, N, pass_) is None
        ):
            return other.name, f"{backend} cannot run here ({reason}); using {other.name}"
    return None, reason


def _emulates_on_cpu(mods: SiteMods, device: torch.device, config: ApplyConfig) -> bool:
    """Whether a site's FP8 passes run on ``torch.native`` here instead of their planned
    backends (`ApplyConfig.emulate_on_cpu`): every FP8 pass must be one it runs."""
    from loka.kernels.native import native_refusal

    if device.type != "cpu" or not config.emulate_on_cpu or config.fuse_norm or mods.fuse_norm:
        return False
    # The recipe alone: torch.native.cpu emulates the GEMM and takes any shape.
    fp8 = [p.recipe for p in mods.fp8.passes().values() if not p.is_bf16]
    return bool(fp8) and all(
        native_refusal(r.a_format, r.b_format, r.granularity, r.scaling) is None for r in fp8
    )


def _on_device(
    name: str, mods: SiteMods, device: torch.device, K: int, N: int, config: ApplyConfig
) -> tuple[SiteMods | None, bool, str | None]:
    """(the site's mods with backends that run on `device`, whether torch.native emulates
    it, the reason when none runs)."""
    from loka.kernels.native import NATIVE_CPU_BACKEND

    if _emulates_on_cpu(mods, device, config):
        passes = {
            p: c if c.is_bf16 else PassConfig(c.recipe, NATIVE_CPU_BACKEND)
            for p, c in mods.fp8.passes().items()
        }
        return dataclasses.replace(mods, fp8=mods.fp8.replace(**passes)), True, None
    passes = {}
    for pass_, pass_config in mods.fp8.passes().items():
        if pass_config.is_bf16 or pass_config.backend is None:
            passes[pass_] = pass_config
            continue
        backend, note = _runnable_backend(
            pass_config, device, K, N, pass_, config.replace_unrunnable_backends
        )
        if backend is None:
            return None, False, f"{name!r} {pass_}: {note}"
        if note:
            warnings.warn(f"loka: {name} {pass_}: {note}", PlanFallbackWarning, stacklevel=4)
        passes[pass_] = PassConfig(pass_config.recipe, backend)
    return dataclasses.replace(mods, fp8=mods.fp8.replace(**passes)), False, None


def _fusable(rows: list[dict]) -> bool:
    """A site the plan names a norm for, whose forward recipe the fused norm+quantize kernel
    runs (rowwise, dynamic): what `ApplyConfig.fuse_norm` fuses."""
    from loka.dispatch.bench.candidates import fusable

    fwd = next(r for r in rows if r["pass"] == "fwd")
    return fwd.get("norm") is not None and fusable(fwd["recipe"])


def _warn_if_timed_elsewhere(plan: Plan, device: torch.device) -> None:
    """Kernel choices are only as good as the timings: say so when the plan's times are
    estimates, or were measured on another GPU than the one the model is on."""
    planned_on = plan.summary.device
    if device.type != "cuda" or planned_on in ("unknown", "none", ""):
        return
    here = torch.cuda.get_device_name(device)
    if planned_on != here:
        warnings.warn(
            f"loka: the plan's kernel times are for {planned_on}, the model runs on {here}: "
            "the choices may not be the fastest here (re-plan with `loka bench` on this GPU)",
            PlanFallbackWarning,
            stacklevel=3,
        )
    elif plan.summary.estimated:
        log.warning("loka: the plan's kernel times are estimates, not measured on this GPU")


def apply(
    model: nn.Module,
    plan: Plan | pl.DataFrame | str | os.PathLike[str],
    config: ApplyConfig | None = None,
    *,
    sample: Any = None,
) -> Applied:
    """Apply `plan` (a `Plan`, a plan table, or a plan file) to `model` in place.

    Returns an `Applied` (undo with `.undo()`). Raises `PlanMismatchError` with the model
    unchanged when the plan does not fit (any site with ``strict=True``; most sites always).
    `sample` is one model input: a fused norm (the plan's, or ``config.fuse_norm``) is kept
    only if the fused model matches the original on it, so fusion needs it. A
    `torch.compile`'d model is changed through the module it compiles (site names are that
    module's); it recompiles on its next call.
    """
    model = getattr(model, "_orig_mod", model)
    config = config or ApplyConfig()
    plan = _as_plan(plan)
    recorded = _recorded_demotions(plan)
    table = plan.table
    device = _model_device(model)
    linears = _linear_sites(model)
    planned = json.loads(plan.metadata["sites"]) if "sites" in plan.metadata else {}
    tokens_vary = set(json.loads(plan.metadata.get("tokens_vary", "[]")))
    rows_by_site: dict[str, list[dict]] = {}
    for row in table.iter_rows(named=True):
        rows_by_site.setdefault(row["site"], []).append(row)

    problems: dict[str, str] = {}
    for name, rows in rows_by_site.items():
        if (reason := _check_site(name, rows, linears, planned)) is not None:
            problems[name] = reason
    matched = len(rows_by_site) - len(problems)
    if rows_by_site and 2 * matched <= len(rows_by_site):  # half or more do not match
        fingerprint = sites_fingerprint(
            (n, m.in_features, m.out_features) for n, m in linears.items()
        )
        raise PlanMismatchError(
            f"this plan was made for another model (plan fingerprint "
            f"{plan.metadata.get('model_fingerprint', 'unknown')}, this model's {fingerprint}): "
            f"{len(problems)} of its {len(rows_by_site)} sites do not match, e.g. "
            + "; ".join(list(problems.values())[:3])
        )
    _warn_if_timed_elsewhere(plan, device)
    fp8_rows = {n: r for n, r in rows_by_site.items() if any(x["recipe"] != "bf16" for x in r)}
    notes: dict[str, str] = {}
    wanted: dict[str, list[dict]] = {}
    for name, rows in fp8_rows.items():
        if name in problems:
            continue
        module = linears[name]
        if config.module_filter_fn is not None and not config.module_filter_fn(module, name):
            notes[name] = "excluded by module_filter_fn"
            continue
        wanted[name] = rows
    # Plan rows become typed site mods here, once; a site whose rows are refused stays bf16.
    also_fused = [n for n, rows in wanted.items() if _fusable(rows)] if config.fuse_norm else []
    site_mods, refused = site_mods_from_plan(
        [r for rows in wanted.values() for r in rows], fuse_norm=also_fused
    )
    problems.update(refused)
    sites: dict[str, SiteMods] = {}
    emulated: list[str] = []  # sites run on torch.native on the CPU (ApplyConfig.emulate_on_cpu)
    for name, mods in site_mods.items():
        module = linears[name]
        mods, emulates, reason = _on_device(
            name, mods, device, module.in_features, module.out_features, config
        )
        if mods is None:
            problems[name] = reason
            continue
        if mods.needs_norm and fsdp_managed(module):
            # FSDP gathers this linear's weights into this very module: its FP8 passes apply
            # in place, while a norm fusion would replace modules whose shards it manages.
            if mods.fp8 is None:
                problems[name] = f"{name!r}: only a norm fusion, which FSDP-managed modules skip"
                continue
            warnings.warn(
                f"loka: {name}: FSDP (fully_shard) manages it: its FP8 passes apply, its norm "
                "fusion does not (apply the plan before fully_shard to fuse)",
                PlanFallbackWarning, stacklevel=2,
            )  # fmt: skip
            mods = dataclasses.replace(
                mods, fuse_norm=False, smooth=None, fold_norm_bias=False, norm=None
            )
        changes = {"bias_grad": config.bias_grad} if config.bias_grad is not None else {}
        changes |= {"tokens_vary": True} if name in tokens_vary else {}
        changes |= {} if config.eager_graphs else {"eager_graphs": False}
        if changes and mods.fp8 is not None:
            mods = dataclasses.replace(mods, fp8=mods.fp8.replace(**changes))
        sites[name] = mods
        if emulates:
            emulated.append(name)
    relevant = {n: p for n, p in problems.items() if n in fp8_rows or config.strict}
    if relevant and config.strict:
        raise PlanMismatchError("plan does not fit this model: " + "; ".join(relevant.values()))
    for reason in relevant.values():
        warnings.warn(f"loka: {reason}; the site stays bf16", PlanFallbackWarning, stacklevel=2)
    fused = sorted(n for n, m in sites.items() if m.fuse_norm)
    if fused and sample is None:
        if config.fuse_norm:
            raise ValueError(
                "ApplyConfig.fuse_norm checks each fused model on a batch: pass a sample batch"
            )
        # A fusion is checked on a sample batch (the norm's output may feed something no
        # table records, a residual say); without it the plan's costing does not hold either.
        message = (
            f"the plan fuses the norm feeding {fused}; pass sample= (one model input) to apply "
            "so the fused model can be checked against the original"
        )
        if config.strict:
            raise PlanMismatchError(message)
        warnings.warn(f"loka: {message}; those sites stay bf16", PlanFallbackWarning, stacklevel=2)
        for site in fused:
            relevant[site] = "the plan fuses its norm and no sample was given"
            del sites[site]
    report = None
    before = dict(model.named_modules())
    while sites:
        try:
            report = mods_apply(model, ModSpec(sites=sites), sample)
            break
        except ModsError as exc:
            at_fault = set(exc.problems) & set(sites)
            if config.strict or not at_fault:
                raise PlanMismatchError(f"loka.mods refused the plan: {exc}") from exc
            # loka.mods names the sites it refuses: those stay bf16, the rest is applied.
            for site in sorted(at_fault):
                relevant[site] = exc.problems[site]
                warnings.warn(
                    f"loka: {exc.problems[site]}; the site stays bf16", PlanFallbackWarning,
                    stacklevel=2,
                )  # fmt: skip
                del sites[site]
    fallbacks = {**{n: relevant[n] for n in relevant}, **notes}
    applied = Applied(model, plan, sorted(sites), fallbacks, report,
                      emulated=sorted(set(emulated) & set(sites)))  # fmt: skip
    applied.variants = _variants(before, model, set(sites))
    _demote_as_recorded(applied, *recorded)
    prequantize = config.prequantize_weights
    if prequantize is None:
        prequantize = plan.metadata.get("inference") == "True"
    if prequantize:
        applied.prequantized = sorted(set(prequantize_weights(model)) & set(sites))
    log.info("loka: plan applied: %s", applied.summary())
    return applied
