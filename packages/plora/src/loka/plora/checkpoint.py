"""One checkpoint per adapter, in peft's format (loadable with `PeftModel.from_pretrained`).

A folder holds `adapter_model.safetensors` and `adapter_config.json` (what peft reads),
`loka_job.json` (the job's configuration and metrics) and, when asked, `optimizer.pt` (the
job's AdamW state, to resume). Folders are written to a temporary name and renamed, so a
reader never sees half a checkpoint and a failed save leaves the old one in place.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from loka.plora.model import PackedLora
from loka.plora.optim import PerAdapterOptimizer, orient_adapter_state

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
JOB_NAME = "loka_job.json"
OPTIMIZER_NAME = "optimizer.pt"


def save_adapter(
    packed: PackedLora,
    index: int,
    directory: str | Path,
    *,
    optimizer: PerAdapterOptimizer | None = None,
    base_model_name_or_path: str | None = None,
    metrics: dict[str, Any] | None = None,
) -> Path:
    """Write adapter `index` as a peft LoRA checkpoint folder; returns the folder."""
    packed.check_index(index)
    job = packed.jobs[index]
    directory = Path(directory)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": job.rank,
        "lora_alpha": job.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": sorted(packed.modules),
    }
    record = {"job": job.to_dict(), "metrics": metrics or {}}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        save_file(packed.adapter_state_dict(index), str(tmp / WEIGHTS_NAME))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        (tmp / JOB_NAME).write_text(json.dumps(record, indent=2, default=str))
        if optimizer is not None:
            torch.save(optimizer.state_dict(index), tmp / OPTIMIZER_NAME)
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_adapter(
    packed: PackedLora,
    index: int,
    directory: str | Path,
    *,
    optimizer: PerAdapterOptimizer | None = None,
) -> None:
    """Load a checkpoint folder into adapter `index` (and its optimizer state if given).

    Rank, alpha, every key and shape are checked before anything is copied: a mismatched
    checkpoint raises and leaves this adapter, and every other, as it was.
    """
    packed.check_index(index)
    job = packed.jobs[index]
    directory = Path(directory)
    for needed in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory}: not a LoRA checkpoint ({needed} missing)")
    config = json.loads((directory / CONFIG_NAME).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory}: peft_type is {config.get('peft_type')!r}, expected LORA")
    if int(config.get("r", -1)) != job.rank:
        raise ValueError(
            f"{directory}: checkpoint rank {config.get('r')} does not match adapter "
            f"{job.name!r} rank {job.rank}"
        )
    if float(config.get("lora_alpha", -1)) != float(job.alpha):
        raise ValueError(
            f"{directory}: checkpoint lora_alpha {config.get('lora_alpha')} does not match "
            f"adapter {job.name!r} alpha {job.alpha}"
        )
    state = load_file(str(directory / WEIGHTS_NAME))
    opt_state = None
    if optimizer is not None and (directory / OPTIMIZER_NAME).is_file():
        opt_state = torch.load(directory / OPTIMIZER_NAME, map_location="cpu", weights_only=True)
        _check_optimizer_state(opt_state, packed, index, directory)
    # Validates every tensor before copying any.
    packed.load_adapter_state_dict(index, state)
    if opt_state is not None:
        optimizer.load_state_dict(index, opt_state)


def _check_optimizer_state(state: dict, packed: PackedLora, index: int, directory: Path) -> None:
    try:
        orient_adapter_state(state, packed.adapter_parameters(index))
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None


def _replace_dir(tmp: Path, directory: Path) -> None:
    if not directory.exists():
        tmp.rename(directory)
        return
    old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
    directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
