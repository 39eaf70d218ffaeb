"""loka.plora: packed concurrent LoRA fine-tuning (PLoRA): many LoRA jobs share one frozen
base model.

    packed = convert_to_packed_lora(model, jobs)            # one adapter per job and linear
    plan = plan_lora_jobs(jobs, memory, throughput, gpu_memory_bytes=141 * 1024**3)
    results = train_packs(model, jobs, plan.packs(), data, "adapters/")

`convert_to_packed_lora` gives each target linear one adapter per job; the base GEMM runs
once for the whole packed batch and the adapters run as segmented Triton GEMMs
(`loka.plora.kernels`: `MultiLoraLayout`, `multi_lora_linear`). `PerAdapterOptimizer` keeps
each job's AdamW state, learning rate and clipping apart; `save_adapter` / `load_adapter`
write and read one peft-format checkpoint per job; `train_packs` trains planned packs on a
Hugging Face causal LM. The job planner (`loka.plora.plan`, `loka lora-plan`) decides the
packs. The rest is in the submodules (`loka.plora.runner`, `loka.plora.plan`, ...).

Names are imported on first use: the `loka` command loads this package to find
`loka lora-plan`, and must not load torch and Triton for it.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "loka.plora.checkpoint": ("load_adapter", "save_adapter"),
    "loka.plora.config": ("LoraJobConfig", "PackedLoraConfig"),
    "loka.plora.data": ("TokenBlocks",),
    "loka.plora.kernels": ("MultiLoraLayout", "multi_lora_linear"),
    "loka.plora.model": ("PackedLora", "convert_to_packed_lora"),
    "loka.plora.optim": ("PerAdapterOptimizer",),
    "loka.plora.plan": ("LoraPlan", "plan_lora_jobs"),
    "loka.plora.runner": ("RunnerConfig", "train_packs"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:
    from loka.plora.checkpoint import load_adapter, save_adapter
    from loka.plora.config import LoraJobConfig, PackedLoraConfig
    from loka.plora.data import TokenBlocks
    from loka.plora.kernels import MultiLoraLayout, multi_lora_linear
    from loka.plora.model import PackedLora, convert_to_packed_lora
    from loka.plora.optim import PerAdapterOptimizer
    from loka.plora.plan import LoraPlan, plan_lora_jobs
    from loka.plora.runner import RunnerConfig, train_packs


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(import_module(_MODULE_OF[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loka.plora' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__: list[str] = [
    "LoraJobConfig",
    "LoraPlan",
    "MultiLoraLayout",
    "PackedLora",
    "PackedLoraConfig",
    "PerAdapterOptimizer",
    "RunnerConfig",
    "TokenBlocks",
    "convert_to_packed_lora",
    "load_adapter",
    "multi_lora_linear",
    "plan_lora_jobs",
    "save_adapter",
    "train_packs",
]
