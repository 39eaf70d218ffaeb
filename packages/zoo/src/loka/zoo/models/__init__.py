"""The reference models, each an `nn.Module` built from its config dataclass."""

from loka.zoo.models.dhen import DHEN, DHENConfig
from loka.zoo.models.dlrm import DLRM, DLRMConfig
from loka.zoo.models.features import CTRFeaturesConfig
from loka.zoo.models.hstu import HSTU, HSTUConfig
from loka.zoo.models.interformer import InterFormer, InterFormerConfig
from loka.zoo.models.sasrec import SASRec, SASRecConfig
from loka.zoo.models.sequential import PopularityModel, SequentialConfig, SequentialRecommender
from loka.zoo.models.wukong import Wukong, WukongConfig

__all__ = [
    "DHEN",
    "DLRM",
    "HSTU",
    "CTRFeaturesConfig",
    "DHENConfig",
    "DLRMConfig",
    "HSTUConfig",
    "InterFormer",
    "InterFormerConfig",
    "PopularityModel",
    "SASRec",
    "SASRecConfig",
    "SequentialConfig",
    "SequentialRecommender",
    "Wukong",
    "WukongConfig",
]
