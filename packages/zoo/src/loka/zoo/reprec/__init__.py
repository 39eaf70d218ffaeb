"""REPREC: a frozen SASRec's user embedding, mapped by a small MLP injector
(`loka.mods.reprec`) to soft tokens that condition a frozen causal LM asked whether the
user will buy a candidate next. Needs `transformers`, `peft` and `loka-mods` (imported when
first used; `import loka.zoo.reprec` itself needs torch only).

    report = run_reprec(RepRecConfig(dataset="beauty", device="cuda", bf16=True))
    report.write("results/")
"""

from loka.zoo.reprec.backbone import (
    BackboneConfig,
    PretrainConfig,
    build_backbone,
    load_backbone,
    pretrain_backbone,
    pretraining_stream,
    save_backbone,
    training_texts,
)
from loka.zoo.reprec.evaluate import grouped_metrics, score_eval_set
from loka.zoo.reprec.examples import (
    ACTIVITY_GROUPS,
    EvalSet,
    PromptExamples,
    activity_group,
    eval_set,
    sample_users,
    training_examples,
)
from loka.zoo.reprec.lora import with_lora
from loka.zoo.reprec.model import PromptScorer
from loka.zoo.reprec.pipeline import METHODS, RepRecConfig, RepRecReport, run_reprec
from loka.zoo.reprec.prompts import PromptEncoder, PromptTemplate
from loka.zoo.reprec.tokenizer import build_item_tokenizer
from loka.zoo.reprec.train import TrainConfig, TrainLog, train_scorer

__all__ = [
    "ACTIVITY_GROUPS",
    "METHODS",
    "BackboneConfig",
    "EvalSet",
    "PretrainConfig",
    "PromptEncoder",
    "PromptExamples",
    "PromptScorer",
    "PromptTemplate",
    "RepRecConfig",
    "RepRecReport",
    "TrainConfig",
    "TrainLog",
    "activity_group",
    "build_backbone",
    "build_item_tokenizer",
    "eval_set",
    "grouped_metrics",
    "load_backbone",
    "pretrain_backbone",
    "pretraining_stream",
    "run_reprec",
    "sample_users",
    "save_backbone",
    "score_eval_set",
    "train_scorer",
    "training_examples",
    "training_texts",
    "with_lora",
]
