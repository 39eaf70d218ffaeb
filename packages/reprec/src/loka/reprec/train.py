"""Training a `PromptScorer`'s trainable parameters (the injector for REPREC, the adapters for
LoRA) on prompt examples, epoch by epoch, with the wall time of every epoch."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loka.reprec.examples import TRAIN_SAMPLING, Cut, TrainSampling, training_examples
from loka.reprec.model import PromptScorer
from loka.zoo.data.amazon import AmazonSequences


@dataclass(frozen=True)
class TrainConfig:
    """`history_items` truncates training histories (the "cheap" setting: train on short
    histories, evaluate on long ones); `max_users` subsamples training users."""

    epochs: int = 2
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    num_negatives: int = 2
    negative_sampling: TrainSampling = "uniform"
    cut: Cut = "random"
    history_items: int | None = None
    max_users: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.negative_sampling not in TRAIN_SAMPLING:
            raise ValueError(
                f"negative_sampling must be one of {TRAIN_SAMPLING}, got {self.negative_sampling!r}"
            )


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    examples_per_epoch: int = 0
    trainable_parameters: int = 0


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    compute_loss: Callable[[], torch.Tensor],
    *,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    where: str,
) -> float:
    """Forward (under autocast when asked), then, unless the loss is NaN/Inf (which raises
    `FloatingPointError` with the parameters unchanged), backward and one optimizer step."""
    with torch.autocast(
        device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
    ):
        loss = compute_loss()
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"{where}: loss is {value}; parameters unchanged")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_scorer(
    scorer: PromptScorer,
    data: AmazonSequences,
    config: TrainConfig | None = None,
    *,
    width: int,
    autocast_dtype: torch.dtype | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> TrainLog:
    """AdamW on the parameters that require gradients. Histories are cut to `width` items
    (the user encoder's window). A NaN/Inf loss raises before the optimizer steps.
    `on_step(step, total, loss)` follows progress."""
    config = config or TrainConfig()
    params = [p for p in scorer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the scorer has no trainable parameters")
    device = scorer.device
    users = None
    if config.max_users is not None:
        rng = np.random.default_rng(config.seed)
        users = np.sort(rng.choice(data.num_users, min(config.max_users, data.num_users), False))
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    log = TrainLog(trainable_parameters=sum(p.numel() for p in params))
    scorer.train()
    step, total = 0, None
    for epoch in range(config.epochs):
        examples = training_examples(
            data,
            width=width,
            num_negatives=config.num_negatives,
            negative_sampling=config.negative_sampling,
            cut=config.cut,
            history_items=config.history_items,
            users=users,
            seed=config.seed,
            epoch=epoch,
        ).to(device)
        batches = max(1, len(examples) // config.batch_size)
        log.examples_per_epoch = batches * config.batch_size
        total = total or batches * config.epochs
        _sync(device)
        start = time.perf_counter()
        for b in range(batches):
            rows = slice(b * config.batch_size, (b + 1) * config.batch_size)
            batch = (examples.history[rows], examples.candidates[rows], examples.labels[rows])
            value = optimizer_step(
                optimizer,
                functools.partial(scorer.loss, *batch),
                device=device,
                autocast_dtype=autocast_dtype,
                where=f"epoch {epoch} step {b}",
            )
            log.losses.append(value)
            step += 1
            if on_step is not None:
                on_step(step, total, value)
        _sync(device)
        log.epoch_seconds.append(time.perf_counter() - start)
    scorer.eval()
    return log
