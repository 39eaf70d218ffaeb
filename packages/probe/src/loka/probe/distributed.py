"""Merging every rank's statistics so that all ranks build identical tables."""

from __future__ import annotations

import torch.distributed as dist

from loka.probe.state import SiteState


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def merged_states(states: dict[str, SiteState]) -> list[SiteState]:
    """The sites' states merged over all ranks of the default process group, in a
    deterministic order (collective: every rank must call it). Alone: a consistent copy."""
    local = {name: state.to_dict() for name, state in states.items()}
    if world_size() == 1:
        gathered = [local]
    else:
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, local)
    names: list[str] = []
    for part in gathered:
        names += [name for name in part if name not in names]
    return [SiteState.merged([p[name] for p in gathered if name in p]) for name in names]
