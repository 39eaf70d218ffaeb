"""loka.mods"""

from loka.mods.lordba import (
    LoRDBAConfig,
    LoRDBALinear,
    convert_peft_checkpoint,
    convert_to_lordba,
    load_lordba,
    lordba_footprint,
    save_lordba,
)
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
    "LoRDBAConfig",
    "LoRDBALinear",
    # packed concurrent LoRA (PLoRA)
    "LoraJobConfig",
    "PackedLora",
    "PackedLoraConfig",
    "PerAdapterOptimizer",
    "convert_peft_checkpoint",
    "convert_to_lordba",
    "convert_to_packed_lora",
    "load_adapter",
    "load_lordba",
    "lordba_footprint",
    "save_adapter",
    "save_lordba",
    "train_packs",
]
