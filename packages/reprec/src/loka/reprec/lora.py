"""The LoRA baseline: peft adapters on a copy of the backbone's attention projections,
trained on the same prompts without soft tokens."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn


def with_lora(
    llm: nn.Module,
    *,
    rank: int = 8,
    alpha: int = 16,
    dropout: float = 0.05,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> nn.Module:
    """A peft model around a deep copy of `llm` (left untouched): only the adapters train."""
    import peft

    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(copy.deepcopy(llm), config)


def lora_parameter_count(
    llm: nn.Module, *, rank: int = 8, target_modules: Sequence[str] = ("q_proj", "v_proj")
) -> int:
    """The trainable parameters `with_lora` would add to `llm`: rank x (in + out) for every
    linear whose name ends with a target, counted without building the adapters."""
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in llm.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in target_modules
    )
