"""loka.probe: online, sampled FP8 profiling of every GEMM site of a live model.

from loka.probe import Probe, ProbeConfig

with Probe(model, ProbeConfig()) as probe:
    for batch in batches:
        train_step(batch)
        probe.step()
    probe.save("probe/")
    probe.summary()
"""

from loka.probe.config import (
    DEFAULT_BUDGETS,
    DEFAULT_RECIPES,
    DENSE_HOST_ERROR_MAX_SIZE,
    ProbeConfig,
)
from loka.probe.probe import CompiledModelWarning, Probe
from loka.probe.sites import register_site

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_RECIPES",
    "DENSE_HOST_ERROR_MAX_SIZE",
    "CompiledModelWarning",
    "Probe",
    "ProbeConfig",
    "register_site",
]
