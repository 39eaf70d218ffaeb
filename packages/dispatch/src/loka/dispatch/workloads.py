"""Zoo models as Dispatch workloads: their linear sites' shapes, and Probe runs on them.
(Uses loka-zoo and loka-probe: the `demo` extra.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch
from torch import nn

from loka.dispatch.bench.candidates import m_bucket
from loka.dispatch.bench.runner import Shape

LARGE_MODELS = ("dlrm", "dhen", "wukong", "hstu")


def linear_shapes(setup, batch=None) -> list[tuple[str, int, int, int]]:
    """(site, M, K, N) of every nn.Linear of a zoo setup's model, from one forward pass."""
    model = setup.model
    seen: dict[str, tuple[int, int, int]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(module, args, out, name=name) -> None:
                x = args[0]
                seen[name] = (x.numel() // x.shape[-1], module.in_features, module.out_features)

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            setup.loss(model, batch if batch is not None else next(setup.train_batches()))
    finally:
        for h in handles:
            h.remove()
    return [(name, *shape) for name, shape in seen.items()]


def zoo_shapes(
    names: tuple[str, ...] = LARGE_MODELS, preset: str = "large", device: str | None = None,
    cpu_batch: int = 32,
) -> dict[str, list[tuple[str, int, int, int, bool]]]:  # fmt: skip
    """Per zoo model, (site, M, K, N, fed by its own norm) of its linears at the preset's
    batch size. On the CPU the models run a `cpu_batch` batch and M is scaled to the
    preset's batch (exact for the CTR models, whose rows per sample are fixed; approximate
    for jagged sequences)."""
    import loka.zoo as zoo

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for name in names:
        preset_batch = zoo.preset_config(name, preset)[2]
        batch = preset_batch if device != "cpu" else min(cpu_batch, preset_batch)
        setup = zoo.create(name, preset, device=device, batch_size=batch)
        sample = next(setup.train_batches())
        scale = preset_batch / batch
        fed = _norm_fed(setup.model, sample)
        out[name] = [
            (s, max(1, round(m * scale)), k, n, s in fed)
            for s, m, k, n in linear_shapes(setup, sample)
        ]
        del setup, sample
        if device != "cpu":
            torch.cuda.empty_cache()
    return out


def _norm_fed(model: nn.Module, sample: object) -> set[str]:
    """Linears fed by a norm that feeds nothing else. A workload for the bench, not a plan:
    plans read this from Probe's `sites.norm`."""
    from loka.mods.trace import trace_norm_consumers

    return {linear for _, linear in trace_norm_consumers(model, sample).exclusive_pairs()}


def shapes_of(site_shapes: dict[str, list[tuple]]) -> list[Shape]:
    """The distinct benchmark shapes, largest GEMMs first."""
    found = {Shape(m_bucket(m), k, n) for rows in site_shapes.values() for _, m, k, n, *_ in rows}
    return sorted(found, key=lambda s: -s.M_bucket * s.K * s.N)


def norm_shapes_of(site_shapes: dict[str, list[tuple]]) -> list[tuple[int, int]]:
    """(M bucket, K) of the norms that feed a linear of their own."""
    found = {(m_bucket(m), k) for rows in site_shapes.values() for _, m, k, _, fed in rows if fed}
    return sorted(found)


def probe_zoo(
    name: str,
    preset: str = "tiny",
    *,
    steps: int = 20,
    device: str = "cpu",
    seed: int = 0,
    batch_size: int | None = None,
    probe_config=None,
    autocast: bool = False,
    out: str | os.PathLike[str] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, pl.DataFrame]:
    """Train a zoo model for `steps` steps with Probe attached; return (and optionally save
    to `out`) the sites, tensor_stats and site_errors tables."""
    import loka.zoo as zoo
    from loka.probe import DENSE_HOST_ERROR_MAX_SIZE, Probe, ProbeConfig

    setup = zoo.create(name, preset, device=device, seed=seed, batch_size=batch_size)
    # every site on every step: the small ones' analysis too replays from CUDA graphs
    config = probe_config or ProbeConfig(
        every=1, warmup_steps=0, max_sites_per_step=None, queue_size=max(2, steps),
        host_error_max_size=DENSE_HOST_ERROR_MAX_SIZE,
    )  # fmt: skip
    with Probe(setup.model, config) as probe:

        def step(i: int, loss: float) -> None:
            probe.step()
            if on_step is not None:
                on_step(i, loss)

        zoo.train(setup, steps, autocast_dtype=torch.bfloat16 if autocast else None, on_step=step)
        tables = probe.tables()
        if out is not None:
            probe.save(Path(out))
    return tables
