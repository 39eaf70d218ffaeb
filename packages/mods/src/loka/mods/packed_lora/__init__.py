"""Packed concurrent LoRA fine-tuning (PLoRA): many LoRA jobs share one frozen base model.

`convert_to_packed_lora` gives each target linear one adapter per job; the base GEMM runs
once for the whole packed batch and the adapters run as segmented Triton GEMMs
(`loka.kernels.multi_lora`). `PerAdapterOptimizer` keeps each job's AdamW state, learning
rate and clipping apart; `save_adapter` / `load_adapter` write and read one peft-format
checkpoint per job; `train_packs` trains planned packs on a Hugging Face causal LM.
"""

from loka.mods.packed_lora.checkpoint import load_adapter, save_adapter
from loka.mods.packed_lora.config import LLAMA_TARGET_MODULES, LoraJobConfig, PackedLoraConfig
from loka.mods.packed_lora.data import JobSampler, TokenBlocks
from loka.mods.packed_lora.layer import PackedLoraLinear
from loka.mods.packed_lora.model import PackedLora, convert_to_packed_lora
from loka.mods.packed_lora.optim import AdapterStep, PerAdapterOptimizer
from loka.mods.packed_lora.runner import (
    JobResult,
    RunnerConfig,
    StepProfile,
    packed_train_step,
    profile_pack,
    train_packs,
)

__all__ = [
    "LLAMA_TARGET_MODULES",
    "AdapterStep",
    "JobResult",
    "JobSampler",
    "LoraJobConfig",
    "PackedLora",
    "PackedLoraConfig",
    "PackedLoraLinear",
    "PerAdapterOptimizer",
    "RunnerConfig",
    "StepProfile",
    "TokenBlocks",
    "convert_to_packed_lora",
    "load_adapter",
    "packed_train_step",
    "profile_pack",
    "save_adapter",
    "train_packs",
]
