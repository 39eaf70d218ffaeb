"""`apply(model, spec, sample) -> Report`: make every mod of a `ModSpec`, all or nothing, and
record each change so that `Report.undo()` restores the original modules.

Order: validate everything (names, module types, shapes against the backends, the norm of
every site that needs one: named by the spec, as a plan from Probe's tables does, or else
traced on the sample batch; group layouts) before touching the model; then group,
smooth, fold norm biases, fuse norms, each change checked on the sample batch against the
original outputs while every pass is still in high precision (a fusion whose norm output
feeds something else, say a residual, shows up here); then give the modules their FP8
configs. A failure at any point undoes what was done and re-raises: the model is left as it
was, and `ModsError.problems` names the sites (or groups) at fault. Modules are swapped, never rebuilt: replacements hold the original Parameter objects,
so an optimizer built before `apply` (or after `undo`) keeps working.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from loka.mods.alignment import ShapeError, check_shape
from loka.mods.config import Fp8LinearConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.grouped import GroupedLinear, GroupingError, detect_group_layout, group_candidates
from loka.mods.norm_linear import (
    NORM_TYPES,
    FusionError,
    NormLinear,
    fusable_recipe_reason,
    fuse_pair,
)
from loka.mods.sharding import base_class, fsdp_managed
from loka.mods.smoothing import SmoothingError, fold_norm_bias, scale_channels, smooth
from loka.mods.spec import GroupMods, ModSpec, SiteMods, SpecError
from loka.mods.trace import (
    ConsumerTrace,
    input_channel_amax,
    outputs_match,
    run_model,
    trace_norm_consumers,
)
from loka.mods.weight_stamp import weight_stamp

__all__ = [
    "Change",
    "ModsError",
    "Report",
    "apply",
    "undo",
]


@dataclass
class Change:
    """One change `apply` made: kind ("group", "smooth", "fold_norm_bias", "fuse_norm",
    "fp8"), the module it concerns and what was done. Its undo takes ``exact``: True when no
    parameter changed since `apply` (values are restored bit for bit), False after training
    (in-place rewrites are reversed mathematically, keeping what was learned)."""

    kind: str
    name: str
    detail: str
    _undo: Callable[[bool], None] = field(repr=False, compare=False, default=lambda exact: None)
    _params: list[torch.Tensor] = field(repr=False, compare=False, default_factory=list)


@dataclass
class Report:
    """Every change `apply` made (in order) and every automatic candidate it skipped, with
    the reason. `undo()` reverses the changes, last first."""

    model: nn.Module = field(repr=False)
    changes: list[Change] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, name, reason)
    undone: bool = False
    _stamps: list[tuple[int, int, int]] = field(repr=False, default_factory=list)

    def _touched(self) -> list[torch.Tensor]:
        return [p for change in self.changes for p in change._params]

    def _seal(self) -> None:
        """Remember the stamp of every rewritten parameter as `apply` leaves it (a fused
        optimizer step leaves the version counter alone, hence the stamp)."""
        self._stamps = [weight_stamp(p) for p in self._touched()]

    def undo(self) -> None:
        """Put the original modules back (they hold the same, possibly since trained,
        Parameters) and reverse the in-place rewrites (smoothing, bias folding): exactly if
        nothing changed them since `apply`, else mathematically."""
        if self.undone:
            raise RuntimeError("this report was already undone")
        exact = [weight_stamp(p) for p in self._touched()] == self._stamps
        for change in reversed(self.changes):
            change._undo(exact)
        self.undone = True

    def __str__(self) -> str:
        lines = [f"{len(self.changes)} changes, {len(self.skipped)} skipped"]
        lines += [f"  {c.kind:<15} {c.name}: {c.detail}" for c in self.changes]
        lines += [f"  skipped {kind:<7} {name}: {why}" for kind, name, why in self.skipped]
        return "\n".join(lines)


def undo(model: nn.Module, report: Report) -> None:
    """`report.undo()`, checking that the report was made on `model`."""
    if report.model is not model:
        raise ValueError("this report was made by apply() on another model")
    report.undo()


class ModsError(SpecError):
    """`apply` refused a spec; the model is unchanged. The message lists every problem and
    `problems` maps each site or group at fault to its reasons (empty: the spec itself)."""


def _refuse(problems: dict[str, list[str]]) -> ModsError:
    reasons = [r for rs in problems.values() for r in rs]
    return ModsError(
        "cannot apply mods: " + "; ".join(reasons), {k: "; ".join(v) for k, v in problems.items()}
    )


# --- helpers --------------------------------------------------------------------------------


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent, child = _parent(model, name)
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@dataclass
class _SitePlan:
    name: str
    mods: SiteMods
    linear: nn.Linear
    norm_name: str | None = None
    consumers: list[str] = field(default_factory=list)


# --- validation -----------------------------------------------------------------------------


def _validate(
    model: nn.Module, spec: ModSpec, sample: Any
) -> tuple[list[_SitePlan], dict[str, GroupMods], ConsumerTrace | None, list[tuple[str, str, str]]]:
    problems: defaultdict[str, list[str]] = defaultdict(list)  # site or group -> reasons
    skipped: list[tuple[str, str, str]] = []
    if not isinstance(spec, ModSpec):
        raise ModsError(f"spec must be a ModSpec, got {type(spec).__name__}")
    if spec.needs_sample and sample is None:
        raise ModsError(
            "this spec traces the model (norm fusion, smoothing, bias folding, grouping "
            "without a layout): pass a sample batch"
        )
    sites: list[_SitePlan] = []
    for name, mods in spec.sites.items():
        module = _find(model, name)
        if module is None:
            problems[name].append(f"{name!r}: no such module")
            continue
        if base_class(module) is not nn.Linear:
            problems[name].append(
                f"{name!r} is a {type(module).__name__}, not an nn.Linear (already modified, "
                "or not a linear)"
            )
            continue
        if fsdp_managed(module) and mods.needs_norm:
            problems[name].append(
                f"{name!r}: FSDP (fully_shard) manages its parameters, and norm fusion, "
                "smoothing and norm-bias folding replace or rewrite modules around it: apply "
                "them before fully_shard (its FP8 passes alone apply as they are)"
            )
            continue
        config = mods.config()
        try:
            check_shape(config, module.in_features, module.out_features, name)
        except ShapeError as exc:
            problems[name].append(str(exc))
        if mods.fuse_norm and (reason := fusable_recipe_reason(config)):
            problems[name].append(f"{name!r}: cannot fuse its norm: {reason}")
        sites.append(_SitePlan(name, mods, module))
    groups = dict(spec.groups)
    _validate_groups(model, spec, groups, sample, skipped, problems)
    for name in spec.sites:
        inside = [g for g in groups if name.startswith(g + ".")]
        if inside:
            problems[name].append(f"{name!r} is inside group {inside[0]!r}")
    # Only what must be traced is: a norm the spec names (a plan's, found by Probe) is not.
    trace = None
    if sample is not None and (spec.auto_fuse or any(s.mods.needs_trace for s in sites)):
        trace = trace_norm_consumers(model, sample)
    for site in sites:
        if site.mods.needs_norm:
            resolved = (
                _resolve_norm(model, site, trace) if trace is not None else _named_norm(model, site)
            )
            problems[site.name] += resolved
    if any(problems.values()):
        raise _refuse({k: v for k, v in problems.items() if v})
    return sites, groups, trace, skipped


def _validate_groups(
    model: nn.Module,
    spec: ModSpec,
    groups: dict[str, GroupMods],
    sample: Any,
    skipped: list[tuple[str, str, str]],
    problems: defaultdict[str, list[str]],
) -> None:
    if spec.auto_group:
        for name in group_candidates(model):
            if any(site.startswith(name + ".") for site in spec.sites):
                skipped.append(("group", name, "the spec configures linears inside it"))
            else:
                groups.setdefault(name, GroupMods())
    for name, mods in list(groups.items()):
        module = _find(model, name)
        if module is None:
            problems[name].append(f"group {name!r}: no such module")
            continue
        if any(fsdp_managed(m) for m in module.modules()):
            reason = "FSDP (fully_shard) manages its linears; group them before sharding"
            if name in spec.groups:
                problems[name].append(f"group {name!r}: {reason}")
            else:
                skipped.append(("group", name, reason))
            del groups[name]
            continue
        try:
            layout = mods.layout or detect_group_layout(model, name, sample)
            # Building it checks the linears, the backend and its recipes (the grouped
            # kernel takes any shape).
            GroupedLinear(module, layout, backend=mods.backend, config=mods.fp8)
        except GroupingError as exc:
            if name in spec.groups:
                problems[name].append(f"group {name!r}: {exc}")
            else:
                skipped.append(("group", name, str(exc)))
            del groups[name]
            continue
        groups[name] = GroupMods(mods.backend, mods.fp8, layout)


def _named_norm(model: nn.Module, site: _SitePlan) -> list[str]:
    """A fusion's norm as the spec names it (what Probe traced): checked to be a norm that
    can fuse; whether its output feeds only this linear is checked on the sample batch."""
    norm = _find(model, site.mods.norm)
    if norm is None:
        return [f"{site.name!r}: no norm module {site.mods.norm!r} (the spec names it)"]
    if not isinstance(norm, NORM_TYPES):
        return [
            f"{site.name!r}: {site.mods.norm!r} is a {type(norm).__name__}, not an "
            "nn.LayerNorm or nn.RMSNorm"
        ]
    site.norm_name = site.mods.norm
    site.consumers = [site.name]
    return []


def _resolve_norm(model: nn.Module, site: _SitePlan, trace: ConsumerTrace) -> list[str]:
    feeding = [norm for (norm, lin) in trace.consumed if lin == site.name]
    if not feeding:
        return [
            f"{site.name!r}: no LayerNorm/RMSNorm output reaches it directly on the sample "
            "batch (needed to fuse, smooth or fold a norm)"
        ]
    if len(feeding) > 1:
        return [f"{site.name!r}: fed by several norms {feeding}"]
    norm = feeding[0]
    if site.mods.norm is not None and site.mods.norm != norm:
        return [f"{site.name!r}: the spec names norm {site.mods.norm!r} but {norm!r} feeds it"]
    site.norm_name = norm
    site.consumers = trace.consumers(norm)
    if site.mods.fuse_norm and (norm, site.name) not in trace.exclusive_pairs():
        return [
            f"{site.name!r}: norm {norm!r} also feeds {[c for c in site.consumers if c != site.name]} "
            "or runs a different number of times: it cannot be fused into one linear"
        ]
    others = [c for c in site.consumers if base_class(model.get_submodule(c)) is not nn.Linear]
    if others and (site.mods.smooth is not None or site.mods.fold_norm_bias):
        return [f"{site.name!r}: norm {norm!r} also feeds modified modules {others}"]
    return []


# --- apply ----------------------------------------------------------------------------------


def apply(
    model: nn.Module,
    spec: ModSpec,
    sample: Any = None,
    *,
    calibration: Iterable[Any] | None = None,
) -> Report:
    """Apply every mod of `spec` to `model` in place and return the `Report`.

    `sample` is one input of the model (a tuple is unpacked into positional arguments), used
    to trace norms and groups and to check every structural change; `calibration` (default:
    ``[sample]``) are the batches that measure activation amaxes for smoothing when
    ``spec.activation_amax`` lacks them. Raises `ModsError` listing every problem (missing
    module, a non-linear where a linear is needed, a shape no backend runs, a norm that cannot
    be fused...) with the model unchanged.
    """
    sites, groups, trace, skipped = _validate(model, spec, sample)
    report = Report(model, skipped=skipped)
    # The original outputs, against which every structural change is checked; none is made
    # for a spec of FP8 configs only (no forward: under FSDP2 a first forward without grad
    # before training leaves the gradients of the first step wrong, in torch 2.11).
    structural = groups or spec.auto_fuse or any(site.mods.needs_norm for site in sites)
    reference = run_model(model, sample) if sample is not None and structural else None
    try:
        _apply_groups(model, groups, report, sample, reference, spec)
        _apply_smoothing(model, spec, sites, report, sample, reference, calibration)
        _apply_bias_folding(model, sites, report, sample, reference)
        fused = _apply_fusions(model, spec, sites, trace, report, sample, reference)
        _apply_final_configs(model, sites, groups, fused, report)
    except BaseException:
        for change in reversed(report.changes):
            change._undo(True)
        raise
    report._seal()
    return report


def _check(model: nn.Module, sample: Any, reference: Any) -> str | None:
    if sample is None:
        return None
    return outputs_match(run_model(model, sample), reference)


def _apply_groups(model, groups, report, sample, reference, spec) -> None:
    for name, mods in list(groups.items()):
        container = model.get_submodule(name)
        grouped = GroupedLinear(container, mods.layout, backend="bmm")
        _swap(model, name, grouped)
        differs = _check(model, sample, reference)
        if differs is not None:
            grouped.restore(container)
            _swap(model, name, container)
            if name in spec.groups:
                raise _refuse(
                    {name: [f"group {name!r}: the grouped model differs on the sample: {differs}"]}
                )
            report.skipped.append(("group", name, f"outputs differ: {differs}"))
            del groups[name]
            continue

        def restore(exact: bool, name=name, grouped=grouped, container=container) -> None:
            _swap(model, name, grouped.restore(container))

        detail = f"{len(grouped.linear_names)} linears as one {mods.backend} GEMM ({mods.layout})"
        report.changes.append(Change("group", name, detail, restore))


def _norm_groups(sites: list[_SitePlan], want: Callable[[SiteMods], bool]) -> dict[str, _SitePlan]:
    """One site per norm among the sites that want this mod (smoothing or folding act on the
    norm and all its consumers at once)."""
    chosen: dict[str, _SitePlan] = {}
    for site in sites:
        if want(site.mods) and site.norm_name not in chosen:
            chosen[site.norm_name] = site
    return chosen


def _apply_smoothing(model, spec, sites, report, sample, reference, calibration) -> None:
    chosen = _norm_groups(sites, lambda m: m.smooth is not None)
    if not chosen:
        return
    need = [s.name for s in chosen.values() if s.name not in spec.activation_amax]
    measured = input_channel_amax(model, need, calibration or [sample]) if need else {}
    for norm_name, site in chosen.items():
        norm = model.get_submodule(norm_name)
        linears = [model.get_submodule(c) for c in site.consumers]
        params = [p for p in (norm.weight, getattr(norm, "bias", None)) if p is not None]
        params += [lin.weight for lin in linears]
        saved = [p.detach().clone() for p in params]
        amax = spec.activation_amax.get(site.name, measured.get(site.name))
        try:
            factors = smooth(norm, linears, amax, site.mods.smooth)
        except SmoothingError as exc:
            raise _refuse({site.name: [f"smoothing {site.name!r}: {exc}"]}) from None

        def restore(exact: bool, params=params, saved=saved, norm=norm, linears=linears, factors=factors) -> None:  # fmt: skip
            with torch.no_grad():
                if exact:
                    for p, value in zip(params, saved, strict=True):
                        p.copy_(value)
                else:  # trained since: unfold the factors, keeping what was learned
                    scale_channels(norm, linears, 1.0 / factors)

        report.changes.append(
            Change(
                "smooth", norm_name,
                f"alpha {site.mods.smooth}: factors {float(factors.min()):.3g}..{float(factors.max()):.3g} "
                f"folded into it and {site.consumers}", restore, params,
            )
        )  # fmt: skip
        differs = _check(model, sample, reference)
        if differs is not None:
            raise _refuse({site.name: [f"smoothing {norm_name!r} changed the outputs: {differs}"]})


def _apply_bias_folding(model, sites, report, sample, reference) -> None:
    for norm_name, site in _norm_groups(sites, lambda m: m.fold_norm_bias).items():
        norm = model.get_submodule(norm_name)
        linears = [model.get_submodule(c) for c in site.consumers]
        biases = [lin.bias for lin in linears]
        saved = [b.detach().clone() if b is not None else None for b in biases]
        try:
            moved = fold_norm_bias(norm, linears)
        except SmoothingError as exc:
            raise _refuse({site.name: [f"folding the bias of {norm_name!r}: {exc}"]}) from None
        params = [norm.bias, *biases]

        def restore(exact: bool, norm=norm, linears=linears, moved=moved, saved=saved) -> None:
            with torch.no_grad():
                if exact:
                    for linear, value in zip(linears, saved, strict=True):
                        linear.bias.copy_(value)
                else:  # trained since: take W beta back out of the (trained) biases
                    for linear in linears:
                        delta = linear.weight.double() @ moved.double().to(linear.weight.device)
                        linear.bias.sub_(delta.to(linear.bias.dtype))
                norm.bias.copy_(moved)
                norm.bias.requires_grad_(True)

        report.changes.append(
            Change(
                "fold_norm_bias", norm_name, f"bias moved into {site.consumers}", restore, params
            )
        )
        differs = _check(model, sample, reference)
        if differs is not None:
            reason = f"folding the bias of {norm_name!r} changed the outputs: {differs}"
            raise _refuse({site.name: [reason]})


def _apply_fusions(model, spec, sites, trace, report, sample, reference) -> dict[str, NormLinear]:
    wanted: dict[str, tuple[str, bool]] = {}  # linear -> (norm, explicit)
    for site in sites:
        if site.mods.fuse_norm:
            wanted[site.name] = (site.norm_name, True)
    if spec.auto_fuse and trace is not None:
        for norm, linear in trace.exclusive_pairs():
            module = model.get_submodule(linear)
            if linear in wanted or type(module) is not nn.Linear:
                continue
            if fsdp_managed(module) or fsdp_managed(model.get_submodule(norm)):
                report.skipped.append(("fuse_norm", linear, "FSDP (fully_shard) manages it"))
                continue
            site = spec.sites.get(linear)
            reason = fusable_recipe_reason(site.config()) if site is not None else None
            if reason is not None:
                report.skipped.append(("fuse_norm", linear, reason))
            else:
                wanted[linear] = (norm, False)
    fused: dict[str, NormLinear] = {}
    for linear_name, (norm_name, explicit) in wanted.items():
        norm = model.get_submodule(norm_name)
        linear = model.get_submodule(linear_name)
        try:
            fused_norm, norm_linear = fuse_pair(norm, linear, Fp8LinearConfig.bf16())
        except FusionError as exc:
            if explicit:
                reason = f"fusing {norm_name!r} into {linear_name!r}: {exc}"
                raise _refuse({linear_name: [reason]}) from None
            report.skipped.append(("fuse_norm", linear_name, str(exc)))
            continue
        _swap(model, norm_name, fused_norm)
        _swap(model, linear_name, norm_linear)
        differs = _check(model, sample, reference)
        if differs is not None:
            _swap(model, norm_name, norm)
            _swap(model, linear_name, linear)
            if explicit:
                reason = (
                    f"fusing {norm_name!r} into {linear_name!r} changes the outputs ({differs}): "
                    "the norm's output also feeds something other than the linear"
                )
                raise _refuse({linear_name: [reason]})
            report.skipped.append(("fuse_norm", linear_name, f"outputs differ: {differs}"))
            continue

        def restore(
            exact: bool, norm_name=norm_name, linear_name=linear_name, norm=norm, linear=linear
        ) -> None:
            _swap(model, linear_name, linear)
            _swap(model, norm_name, norm)

        report.changes.append(
            Change("fuse_norm", linear_name, f"{norm_name} fused (norm + quantize kernel)", restore)
        )
        fused[linear_name] = norm_linear
    return fused


def _apply_final_configs(model, sites, groups, fused, report) -> None:
    """Checks are done: give groups their backends and linears their FP8 configs."""
    for name, mods in groups.items():
        grouped = model.get_submodule(name)
        if mods.backend == "bmm":
            continue
        # Undoing the group's change puts the container back: no change of its own.
        grouped.set_backend(mods.backend, mods.fp8)
    for site in sites:
        config = site.mods.config()
        if site.name in fused:
            if config.is_bf16:
                continue
            module = fused[site.name]
            module._init_fp8(config)

            def reset(exact: bool, module=module) -> None:
                module._init_fp8(Fp8LinearConfig.bf16())

            report.changes.append(Change("fp8", site.name, str(config), reset))
            continue
        if site.mods.fp8 is None:
            continue
        if fsdp_managed(site.linear):  # FSDP fills this very object: changed in place
            module = Fp8Linear.in_place(site.linear, config)

            def revert(exact: bool, module=module) -> None:
                module.to_linear()

            report.changes.append(Change("fp8", site.name, f"{config} (in place)", revert))
            continue
        new = Fp8Linear.from_linear(site.linear, config)
        _swap(model, site.name, new)

        def restore(exact: bool, name=site.name, linear=site.linear, new=new) -> None:
            if fsdp_managed(new):  # sharded since: FSDP fills this object, changed back in place
                new.to_linear()
            else:
                _swap(model, name, linear)

        report.changes.append(Change("fp8", site.name, str(config), restore))
