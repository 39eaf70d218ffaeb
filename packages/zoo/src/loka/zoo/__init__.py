"""loka.zoo: reference recommendation models and their data, tiny (CPU tests) to xl
(production-sized dense arches on one H200).

    setup = loka.zoo.create("dhen", "tiny")
    losses = loka.zoo.train(setup, steps=50)
    print(setup.metrics(setup.model, setup.eval_batches()))
"""

from loka.zoo.estimate import H200, Device, StepEstimate, estimate_step
from loka.zoo.layers import RMSNorm
from loka.zoo.metrics import binary_auc, ctr_metrics, ranking_metrics
from loka.zoo.models import (
    DHEN,
    DLRM,
    HSTU,
    DHENConfig,
    DLRMConfig,
    HSTUConfig,
    InterFormer,
    InterFormerConfig,
    PopularityModel,
    SASRec,
    SASRecConfig,
    Wukong,
    WukongConfig,
)
from loka.zoo.optim import (
    HybridOptimizer,
    OptimizerConfig,
    RowWiseAdagrad,
    embedding_update,
    make_optimizer,
)
from loka.zoo.registry import PRESETS, SPECS, SequenceDataConfig, ZooSetup, create, preset_config
from loka.zoo.train import train, training_step

MODELS = tuple(SPECS)

__all__ = [
    "DHEN",
    "DLRM",
    "H200",
    "HSTU",
    "MODELS",
    "PRESETS",
    "DHENConfig",
    "DLRMConfig",
    "Device",
    "HSTUConfig",
    "HybridOptimizer",
    "InterFormer",
    "InterFormerConfig",
    "OptimizerConfig",
    "PopularityModel",
    "RMSNorm",
    "RowWiseAdagrad",
    "SASRec",
    "SASRecConfig",
    "SequenceDataConfig",
    "StepEstimate",
    "Wukong",
    "WukongConfig",
    "ZooSetup",
    "binary_auc",
    "create",
    "ctr_metrics",
    "embedding_update",
    "estimate_step",
    "make_optimizer",
    "preset_config",
    "ranking_metrics",
    "train",
    "training_step",
]
# Modules whose own `__all__` is public too (CONTRIBUTING.md, "Public faces").
__public_modules__ = (
    "data.amazon",
    "data.seeding",
    "metrics",
    "tasks",
)
