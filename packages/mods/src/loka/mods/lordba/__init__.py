"""LoRDBA: binary-sign LoRA adapters with channel-wise scales.

``out = base(x) + s * p * (sign(B) @ (m * (sign(A) @ (q * x))))``: two sign matmuls with
channel scales, trained through latent factors with a straight-through estimator, stored as
packed bits plus fp16 scales.
"""

from loka.mods.lordba.config import LoRDBAConfig
from loka.mods.lordba.convert import convert_to_lordba
from loka.mods.lordba.fit import LoRDBAFit, fit_lora
from loka.mods.lordba.module import LoRDBALinear
from loka.mods.lordba.peft import PeftConversion, convert_peft_checkpoint
from loka.mods.lordba.storage import (
    Footprint,
    PackedLoRDBA,
    load_lordba,
    lordba_footprint,
    read_lordba,
    save_lordba,
)

__all__ = [
    "Footprint",
    "LoRDBAConfig",
    "LoRDBAFit",
    "LoRDBALinear",
    "PackedLoRDBA",
    "PeftConversion",
    "convert_peft_checkpoint",
    "convert_to_lordba",
    "fit_lora",
    "load_lordba",
    "lordba_footprint",
    "read_lordba",
    "save_lordba",
]
