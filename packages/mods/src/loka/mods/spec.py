"""`ModSpec`: which mods `loka.mods.apply` makes, per linear and per group of linears.

Built by hand or from a plan table (`ModSpec.from_plan`: one row per site and pass with its
backend and recipe, the `plan` table of loka.dispatch).
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


class SpecError(ValueError):
    """A spec or plan that cannot be applied to this model (the message names every problem)."""


@dataclass(frozen=True)
class SiteMods:
    """Mods of one linear.

    fp8: its per-pass backends and recipes (None: leave its passes as they are).
    fuse_norm: run the norm that feeds it and the quantization of the norm's output as one
        kernel (`NormLinear`). The norm is found by tracing the sample batch; it must feed
        this linear only.
    smooth: SmoothQuant's alpha (0..1) for outlier smoothing between the norm that feeds it
        and the linears that norm feeds; None: no smoothing.
    fold_norm_bias: move that norm's bias into this linear's bias.
    pad: pad M, K and N to what the backends need (the align mod): ``fp8.pad = True``.
    norm: the norm's module name, to check the traced one (None: whatever the trace finds).
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
        """A spec from plan rows: mappings (or a polars DataFrame) with keys ``site``,
        ``pass`` (fwd, dgrad, wgrad), ``backend`` and ``recipe`` (a string or recipe object).
        Every site needs its three passes; a site with all three in bf16 is left alone.
        `groups` names sites that are containers of linears to group (FP8 if any pass is).
        `fuse_norm` fuses the norm feeding every site (True) or the listed sites; `pad`
        aligns every FP8 site's shapes."""
        if hasattr(rows, "iter_rows"):
            rows = rows.iter_rows(named=True)
        per_site: dict[str, dict[str, PassConfig]] = defaultdict(dict)
        problems = []
        for i, row in enumerate(rows):
            try:
                site, pass_ = row["site"], row["pass"]
                backend, recipe = row.get("backend"), row["recipe"]
            except (KeyError, TypeError) as exc:
                problems.append(f"row {i}: needs site, pass, backend and recipe ({exc})")
                continue
            if pass_ not in PASSES:
                problems.append(f"row {i} ({site}): pass must be one of {PASSES}, got {pass_!r}")
                continue
            if pass_ in per_site[site]:
                problems.append(f"site {site!r}: pass {pass_} appears twice")
                continue
            try:
                per_site[site][pass_] = PassConfig(recipe, backend or None)
            except ValueError as exc:
                problems.append(f"site {site!r} {pass_}: {exc}")
        for site, passes in per_site.items():
            missing = [p for p in PASSES if p not in passes]
            if missing:
                problems.append(f"site {site!r}: the plan has no row for {missing}")
        if problems:
            raise SpecError("plan rows cannot be applied: " + "; ".join(problems))
        group_names = set(groups)
        fused = set(per_site) if fuse_norm is True else set(fuse_norm or ())
        sites: dict[str, SiteMods] = {}
        grouped: dict[str, GroupMods] = {}
        for site, passes in per_site.items():
            config = Fp8LinearConfig(passes["fwd"], passes["dgrad"], passes["wgrad"])
            if site in group_names:
                fp8 = not config.is_bf16
                grouped[site] = GroupMods("fp8" if fp8 else "bmm", config if fp8 else None)
            elif not config.is_bf16 or site in fused:
                sites[site] = SiteMods(
                    fp8=config, fuse_norm=site in fused, pad=pad and not config.is_bf16
                )
        unknown = group_names - set(per_site)
        if unknown:
            raise SpecError(f"groups {sorted(unknown)} have no rows in the plan")
        return cls(sites=sites, groups=grouped)
