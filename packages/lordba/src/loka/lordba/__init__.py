"""loka.lordba: binary-sign LoRA adapters with channel-wise scales (LoRDBA).

``out = base(x) + s * p * (sign(B) @ (m * (sign(A) @ (q * x))))``: two sign matmuls with
channel scales, trained through latent factors with a straight-through estimator, stored as
packed bits plus fp16 scales.

    model = convert_to_lordba(model, LoRDBAConfig(rank=8))   # a fresh adapter per linear
    save_lordba(model, "adapter.safetensors")                # signs 8 per byte, fp16 scales
    adapter, fit = LoRDBALinear.from_lora(base, lora_a, lora_b, scaling=2.0)

The sign-GEMM kernels (forward, backward, bit packing) are `loka.lordba.kernels`; result
types (`Footprint`, `PackedLoRDBA`, `PeftConversion`) live in the submodules.
"""

from loka.lordba.config import LoRDBAConfig
from loka.lordba.convert import convert_to_lordba
from loka.lordba.fit import LoRDBAFit, fit_lora
from loka.lordba.module import LoRDBALinear
from loka.lordba.peft import convert_peft_checkpoint
from loka.lordba.quantized import (
    Fp8WeightOnlyLinear,
    dequantized_linear,
    dequantized_weight,
    quantize_fp8_weights,
)
from loka.lordba.storage import load_lordba, lordba_footprint, read_lordba, save_lordba

__all__: list[str] = [
    "Fp8WeightOnlyLinear",
    "LoRDBAConfig",
    "LoRDBAFit",
    "LoRDBALinear",
    "convert_peft_checkpoint",
    "convert_to_lordba",
    "dequantized_linear",
    "dequantized_weight",
    "fit_lora",
    "load_lordba",
    "lordba_footprint",
    "quantize_fp8_weights",
    "read_lordba",
    "save_lordba",
]
