"""loka.mods"""

from loka.mods.packed_lora import (
    LoraJobConfig,
    PackedLora,
    PackedLoraConfig,
    PerAdapterOptimizer,
    convert_to_packed_lora,
    load_adapter,
    save_adapter,
    train_packs,
)

__all__: list[str] = [
    # packed concurrent LoRA (PLoRA)
    "LoraJobConfig",
    "PackedLora",
    "PackedLoraConfig",
    "PerAdapterOptimizer",
    "convert_to_packed_lora",
    "load_adapter",
    "save_adapter",
    "train_packs",
]
