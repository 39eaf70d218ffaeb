"""Fit the planner's models from a few profiled packed steps on the real model and GPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from loka.plora.config import LoraJobConfig, PackedLoraConfig
from loka.plora.plan.throughput import ThroughputModel
from loka.plora.runner import StepProfile, profile_pack


def profiling_packs(
    jobs: Sequence[LoraJobConfig], max_jobs: int | None = None
) -> list[list[LoraJobConfig]]:
    """Pack compositions that separate the model's terms: one job, the same job at twice
    its batch (tokens alone change), then the first 2, 4, 8, ... jobs (adapters change)."""
    if not jobs:
        raise ValueError("profiling needs at least one job")
    first = jobs[0]
    packs = [[first], [replace(first, name=f"{first.name}-x2", batch_size=2 * first.batch_size)]]
    limit = min(len(jobs), max_jobs or len(jobs))
    size = 2
    while size <= limit:
        packs.append(list(jobs[:size]))
        size *= 2
    if limit > 1 and len(packs[-1]) != limit:
        packs.append(list(jobs[:limit]))
    return packs


def profile_throughput(
    model: nn.Module,
    jobs: Sequence[LoraJobConfig],
    seq_len: int,
    *,
    config: PackedLoraConfig | None = None,
    max_jobs: int | None = None,
    steps: int = 3,
    on_profile: Callable[[StepProfile], None] | None = None,
    compile: bool = False,
) -> tuple[ThroughputModel, list[StepProfile], list[list[LoraJobConfig]]]:
    """Time the `profiling_packs` of `jobs` on `model` and fit a `ThroughputModel`;
    `compile`: the steps as `RunnerConfig(compile=True)` trains them (`profile_pack`).

    Packs that run out of GPU memory end the profiling (larger ones would too). Returns
    the model, the profiles and the job lists they measured (for `MemoryModel.calibrated`).
    """
    profiles: list[StepProfile] = []
    measured: list[list[LoraJobConfig]] = []
    for pack in profiling_packs(jobs, max_jobs):
        try:
            profile = profile_pack(
                model, pack, seq_len, config=config, steps=steps, compile=compile
            )
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        profiles.append(profile)
        measured.append(pack)
        if on_profile is not None:
            on_profile(profile)
    if len(profiles) < 2:
        raise RuntimeError(
            f"only {len(profiles)} pack(s) could be profiled; the throughput fit needs 2"
        )
    device = profiles[0].device
    fitted = ThroughputModel.fit([p.to_dict() for p in profiles])
    return replace(fitted, source=f"{fitted.source} on {device}"), profiles, measured
