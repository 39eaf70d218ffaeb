"""loka.reprec: REPREC, LLM-based sequential recommendation conditioned by a user embedding.

A frozen SASRec's user embedding, mapped by a small MLP injector to soft tokens that condition
a frozen causal LM asked whether the user will buy a candidate next; only the injector trains.

    report = run_reprec(RepRecConfig(dataset="beauty", device="cuda", bf16=True))
    report.write("results/")

`UserEmbeddingInjector` and `prepend_soft_tokens` (`loka.reprec.injector`) are the method;
`run_reprec` the pipeline around it (SASRec, backbone, prompts, training, evaluation, the
zero-shot, LoRA and SASRec baselines). The pieces live in the submodules (`backbone`,
`examples`, `prompts`, `tokenizer`, `model`, `train`, `evaluate`, `lora`, `pipeline`).

Names are imported on first use: the `loka` command loads this package to find
`loka reprec`, and must not load torch and transformers for it.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "loka.reprec.backbone": ("BackboneConfig", "PretrainConfig"),
    "loka.reprec.injector": ("InjectorConfig", "UserEmbeddingInjector", "prepend_soft_tokens"),
    "loka.reprec.model": ("PromptScorer",),
    "loka.reprec.pipeline": ("RepRecConfig", "RepRecReport", "run_reprec"),
    "loka.reprec.train": ("TrainConfig",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from loka.reprec.backbone import BackboneConfig, PretrainConfig
    from loka.reprec.injector import InjectorConfig, UserEmbeddingInjector, prepend_soft_tokens
    from loka.reprec.model import PromptScorer
    from loka.reprec.pipeline import RepRecConfig, RepRecReport, run_reprec
    from loka.reprec.train import TrainConfig


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(import_module(_MODULE_OF[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loka.reprec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__: list[str] = [
    "BackboneConfig",
    "InjectorConfig",
    "PretrainConfig",
    "PromptScorer",
    "RepRecConfig",
    "RepRecReport",
    "TrainConfig",
    "UserEmbeddingInjector",
    "prepend_soft_tokens",
    "run_reprec",
]
