"""Conversion of a ``peft`` LoRA checkpoint (a directory from ``save_pretrained``) to LoRDBA.

Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``adapter_model.bin``),
fits every ``lora_A``/``lora_B`` pair (:func:`loka.lordba.fit.fit_lora`, with peft's
scaling ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per-module patterns included) and
writes one LoRDBA file whose module names are the base model's (peft's
``base_model.model.`` prefix removed), so :func:`load_lordba` attaches it to the plain model.
Variants a sign adapter cannot express (DoRA, LoRA biases, embedding or conv LoRA, extra
trained modules) are refused with an error naming them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from loka.lordba.fit import LoRDBAFit, fit_lora
from loka.lordba.storage import Footprint, pack_fit, save_lordba

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>A|B)(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class PeftConversion:
    """What a conversion wrote: per-module fits (residual ratios, errors) and the byte totals."""

    path: Path
    fits: dict[str, LoRDBAFit]
    footprint: Footprint


def _pattern_value(patterns: dict, module: str, default):
    # peft's rule: a pattern matches a module name that ends with it at a dot boundary.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _read_checkpoint(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no adapter_config.json (not a peft checkpoint)")
    config = json.loads(config_path.read_text())
    weights_path = directory / "adapter_model.safetensors"
    if weights_path.is_file():
        weights = safetensors.torch.load_file(str(weights_path))
    elif (directory / "adapter_model.bin").is_file():
        weights = torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{directory}: no adapter_model.safetensors or adapter_model.bin")
    return config, weights


def _check_supported(config: dict, weights: dict[str, torch.Tensor], directory: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{directory}: peft_type {peft_type} is not LoRA")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) bases")):
        if config.get(flag):
            raise ValueError(f"{directory}: {what} cannot be converted to LoRDBA")
    others = sorted(k for k in weights if not _LORA_KEY.match(k))
    if others:
        raise ValueError(
            f"{directory}: tensors other than lora_A/lora_B weights cannot be converted "
            f"(DoRA magnitudes, LoRA biases, embedding LoRA or modules_to_save): {others[:5]}"
        )


def convert_peft_checkpoint(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, input_scale: bool = False
) -> PeftConversion:
    """Convert the peft LoRA checkpoint directory ``checkpoint`` to the LoRDBA file ``output``
    (``input_scale``: also fit and store the per-input-channel scale ``q``)."""
    directory = Path(checkpoint)
    config, weights = _read_checkpoint(directory)
    _check_supported(config, weights, directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _LORA_KEY.match(key)
        module = match["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[match["factor"]] = tensor
    if not pairs:
        raise ValueError(f"{directory}: the checkpoint holds no LoRA weights")
    fits: dict[str, LoRDBAFit] = {}
    packed = {}
    lora_bytes = 0
    for module, factors in sorted(pairs.items()):
        if set(factors) != {"A", "B"}:
            raise ValueError(f"{directory}: {module} has lora_{next(iter(factors))} only")
        lora_a, lora_b = factors["A"], factors["B"]
        if lora_a.dim() != 2 or lora_b.dim() != 2:
            raise ValueError(
                f"{directory}: {module} is not a linear LoRA (A {tuple(lora_a.shape)})"
            )
        rank = lora_a.shape[0]
        alpha = _pattern_value(
            config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank)
        )
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        try:
            fits[module] = fit_lora(lora_a, lora_b, scaling, input_scale=input_scale)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{directory}: {module}: {error}") from error
        packed[module] = pack_fit(fits[module], module)
        lora_bytes += 2 * rank * (lora_a.shape[1] + lora_b.shape[0])
    save_lordba(packed, output)
    footprint = Footprint(sum(p.nbytes for p in packed.values()), lora_bytes)
    return PeftConversion(Path(output), fits, footprint)
