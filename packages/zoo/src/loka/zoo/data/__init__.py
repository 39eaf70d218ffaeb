"""Data for the zoo: a synthetic Criteo-like stream (optionally with a behaviour sequence
per example), synthetic sequences, Amazon 5-core."""

from loka.zoo.data.behaviour import SyntheticBehaviour, SyntheticBehaviourConfig
from loka.zoo.data.criteo import (
    CRITEO_CARDINALITIES,
    SyntheticCriteo,
    SyntheticCriteoConfig,
    criteo_cardinalities,
)
from loka.zoo.data.sequences import SyntheticSequences, SyntheticSequencesConfig

__all__ = [
    "CRITEO_CARDINALITIES",
    "SyntheticBehaviour",
    "SyntheticBehaviourConfig",
    "SyntheticCriteo",
    "SyntheticCriteoConfig",
    "SyntheticSequences",
    "SyntheticSequencesConfig",
    "criteo_cardinalities",
]
