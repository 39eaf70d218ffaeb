"""`ModSpec`: which mods `loka.mods.apply` makes, per linear and per group of linears.

Built by hand or from a plan table (`ModSpec.from_plan`, `site_mods_from_plan`: one row per
site and pass with its backend and recipe, the `plan` table of loka.dispatch). Plan rows
become typed configs here and nowhere else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.grouped import BACKENDS, GroupLayout
from loka.schema import PASSES

__all__ = [
    "GroupMods",
    "ModSpec",
    "SiteMods",
    "SpecError",
    "site_mods_from_plan",
]


class SpecError(ValueError):
    """A spec or plan that cannot be applied to this model. The message names every problem;
    `problems` maps each site (or group) at fault to its reasons, and is empty when the
    spec as a whole is at fault."""

    def __init__(self, message: str, problems: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems: dict[str, str] = dict(problems or {})


@dataclass(frozen=True)
class SiteMods:
    """Mods of one linear.

    fp8: its per-pass backends and recipes (None: leave its passes as they are).
    fuse_norm: run the norm that feeds it and the quantization of the norm's output as one
        kernel (`NormLinear`). The norm is `norm` when given (as Probe found it: a plan's
        `norm` column), else found by tracing the sample batch; it must feed this linear
        only, and the fused model is checked against the original on the sample batch.
    smooth: SmoothQuant's alpha (0..1) for outlier smoothing between the norm that feeds it
        and the linears that norm feeds; None: no smoothing.
    fold_norm_bias: move that norm's bias into this linear's bias.
    pad: pad M, K and N to what the backends need (the align mod): ``fp8.pad = True``.
    norm: the norm's module name: fused as named (no trace), or for smoothing and bias
        folding checked against the traced one (None: whatever the trace finds).
    """

    fp8: Fp8LinearConfig | None = None
    fuse_norm: bool = False
    smooth: float | None = None
    fold_norm_bias: bool = False
    pad: bool = False
    norm: str | None = None

    def __post_init__(self) -> None:
        if self.fp8 is not None and not isinstance(self.fp8, Fp8LinearConfig):
            raise SpecError(f"fp8 must be an Fp8LinearConfig, got {type(self.fp8).__name__}")
        if self.smooth is not None and not 0.0 <= float(self.smooth) <= 1.0:
            raise SpecError(f"smooth (alpha) must be in [0, 1], got {self.smooth}")
        if self.pad and self.fp8 is None:
            raise SpecError("pad aligns the shapes of FP8 passes: it needs an fp8 config")

    @property
    def needs_norm(self) -> bool:
        return self.fuse_norm or self.smooth is not None or self.fold_norm_bias

    @property
    def needs_trace(self) -> bool:
        """The norm's consumers must be traced: smoothing and bias folding act on all of them,
        and a fusion must find its norm unless it is named."""
        return self.smooth is not None or self.fold_norm_bias or (self.fuse_norm and not self.norm)

    def config(self) -> Fp8LinearConfig:
        """The config the module ends up with (bf16 passes when only fused)."""
        config = self.fp8 if self.fp8 is not None else Fp8LinearConfig.bf16()
        return config.replace(pad=True) if self.pad else config


@dataclass(frozen=True)
class GroupMods:
    """Grouping of one container of equal-shape linears (see `loka.mods.grouped`).

    backend: "bmm", "fp8" (needs `fp8`) or "loop". layout: how the container feeds its
    linears (None: read from the sample batch).
    """

    backend: str = "bmm"
    fp8: Fp8LinearConfig | None = None
    layout: GroupLayout | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpecError(f"group backend must be one of {BACKENDS}, got {self.backend!r}")
        if (self.backend == "fp8") != (self.fp8 is not None):
            raise SpecError("a group takes an fp8 config exactly when its backend is 'fp8'")


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class ModSpec:
    """Everything `loka.mods.apply` does to a model.

    sites: linear name -> `SiteMods`. groups: container name -> `GroupMods`.
    auto_fuse: also fuse every norm -> linear pair the trace finds where the norm feeds only
        that linear (those pairs keep bf16 passes unless `sites` configures them); a pair
        whose fused model disagrees with the original on the sample is skipped.
    auto_group: also group every container of two or more equal-shape linears (bmm).
    activation_amax: linear name -> per-input-channel amax of its input, for smoothing (e.g.
        from Probe); linears missing here are calibrated on the sample batches.
    """

    sites: Mapping[str, SiteMods] = field(default_factory=dict)
    groups: Mapping[str, GroupMods] = field(default_factory=dict)
    auto_fuse: bool = False
    auto_group: bool = False
    activation_amax: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in (("sites", SiteMods), ("groups", GroupMods)):
            entries = getattr(self, name)
            bad = [k for k, v in entries.items() if not isinstance(v, value)]
            if bad:
                raise SpecError(f"{name} values must be {value.__name__}; not for {bad}")
            object.__setattr__(self, name, _frozen(entries))
        object.__setattr__(self, "activation_amax", _frozen(self.activation_amax))

    @property
    def needs_sample(self) -> bool:
        return (
            self.auto_fuse
            or self.auto_group
            or any(s.needs_norm for s in self.sites.values())
            or any(g.layout is None for g in self.groups.values())
        )

    @classmethod
    def from_plan(
        cls,
        rows: Iterable[Mapping[str, Any]] | Any,
        *,
        fuse_norm: bool | Iterable[str] = False,
        pad: bool = False,
        groups: Iterable[str] = (),
    ) -> ModSpec:
        """A spec from plan rows (see `site_mods_from_plan`); raises `SpecError` naming every
        problem. `groups` names sites that are containers of linears to group (FP8 if any
        pass is)."""
        planned, problems = _read_plan(rows)
        if problems:
            raise SpecError(
                "plan rows cannot be applied: " + "; ".join(problems.values()), problems
            )
        group_names = set(groups)
        unknown = group_names - set(planned)
        if unknown:
            raise SpecError(f"groups {sorted(unknown)} have no rows in the plan")
        grouped: dict[str, GroupMods] = {}
        for site in group_names:
            config = planned.pop(site).config
            fp8 = not config.is_bf16
            grouped[site] = GroupMods("fp8" if fp8 else "bmm", config if fp8 else None)
        return cls(sites=_site_mods(planned, fuse_norm, pad), groups=grouped)


@dataclass(frozen=True)
class _PlannedSite:
    config: Fp8LinearConfig
    fuse_norm: bool  # the plan fuses the norm feeding it (its fwd row's `fuse_norm`)
    norm: str | None  # that norm (the row's `norm`: Probe's `sites.norm`)


def _read_plan(
    rows: Iterable[Mapping[str, Any]] | Any,
) -> tuple[dict[str, _PlannedSite], dict[str, str]]:
    """Each site's typed config, and the reason of every site (or row) that has none."""
    if hasattr(rows, "iter_rows"):
        rows = rows.iter_rows(named=True)
    per_site: dict[str, dict[str, PassConfig]] = defaultdict(dict)
    fwd_rows: dict[str, Mapping[str, Any]] = {}
    problems: defaultdict[str, list[str]] = defaultdict(list)
    for i, row in enumerate(rows):
        try:
            site, pass_ = row["site"], row["pass"]
            backend, recipe = row.get("backend"), row["recipe"]
        except (KeyError, TypeError) as exc:
            problems[f"row {i}"].append(f"row {i}: needs site, pass, backend and recipe ({exc})")
            continue
        if pass_ not in PASSES:
            problems[site].append(f"row {i} ({site}): pass must be one of {PASSES}, got {pass_!r}")
            continue
        if pass_ in per_site[site]:
            problems[site].append(f"site {site!r}: pass {pass_} appears twice")
            continue
        if pass_ == "fwd":
            fwd_rows[site] = row
        try:
            per_site[site][pass_] = PassConfig(recipe, backend or None)
        except ValueError as exc:
            problems[site].append(f"site {site!r} {pass_}: {exc}")
    planned = {}
    for site, passes in per_site.items():
        missing = [p for p in PASSES if p not in passes]
        if missing:
            problems[site].append(f"site {site!r}: the plan has no row for {missing}")
        if site in problems:
            continue
        fwd = fwd_rows[site]
        config = Fp8LinearConfig(passes["fwd"], passes["dgrad"], passes["wgrad"])
        planned[site] = _PlannedSite(config, bool(fwd.get("fuse_norm")), fwd.get("norm"))
    return planned, {site: "; ".join(reasons) for site, reasons in problems.items()}


def _site_mods(
    planned: dict[str, _PlannedSite], fuse_norm: bool | Iterable[str], pad: bool
) -> dict[str, SiteMods]:
    fused = set(planned) if fuse_norm is True else set(fuse_norm or ())
    sites = {}
    for site, p in planned.items():
        fuse = p.fuse_norm or site in fused
        if not p.config.is_bf16 or fuse:
            sites[site] = SiteMods(
                fp8=p.config, fuse_norm=fuse, pad=pad and not p.config.is_bf16,
                norm=p.norm if fuse else None,
            )  # fmt: skip
    return sites


def site_mods_from_plan(
    rows: Iterable[Mapping[str, Any]] | Any,
    *,
    fuse_norm: bool | Iterable[str] = False,
    pad: bool = False,
) -> tuple[dict[str, SiteMods], dict[str, str]]:
    """Per site of plan rows (mappings, or a polars DataFrame, with keys ``site``, ``pass``
    (fwd, dgrad, wgrad), ``backend``, ``recipe`` (a `loka.schema.Recipe` or its string) and
    optionally ``fuse_norm`` and ``norm``, the plan's columns), its `SiteMods`; and per site
    whose rows cannot be applied (a pass missing or twice, a recipe or backend refused), the
    reason, that site left out. Every site needs its three passes; a site with all three in
    bf16 is left alone unless its norm is fused. A site's norm is fused when its fwd row
    says so or `fuse_norm` names it (True: every site), the norm being the row's `norm`
    (None: traced by `apply`); `pad` aligns every FP8 site's shapes."""
    planned, problems = _read_plan(rows)
    return _site_mods(planned, fuse_norm, pad), problems
