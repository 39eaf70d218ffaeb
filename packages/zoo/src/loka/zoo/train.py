"""The minimal training loop: `make_optimizer`'s optimizer (AdamW, plus row-wise Adagrad on
sparse tables), optional bf16 autocast, a per-step callback.

It is plain PyTorch on purpose: it is the baseline that LoKA's trainer integration must stay
compatible with, and what the benchmarks time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from loka.zoo.optim import OptimizerConfig, OptimizerLike, make_optimizer

if TYPE_CHECKING:
    from loka.zoo.registry import ZooSetup

Batch = dict[str, torch.Tensor]


def _check_autocast(autocast_dtype: torch.dtype | None) -> None:
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"autocast_dtype must be None or torch.bfloat16, got {autocast_dtype} "
            "(float16 would need a gradient scaler)"
        )


def training_step(
    setup: ZooSetup,
    model: nn.Module,
    optimizer: OptimizerLike,
    batch: Batch,
    *,
    autocast_dtype: torch.dtype | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """One step: forward and loss (under autocast if asked), backward, optimizer step.

    With `check_finite`, a NaN/Inf loss raises `FloatingPointError` before any parameter
    changes (this reads the loss on the host: one sync per step). Returns the detached loss.
    """
    _check_autocast(autocast_dtype)
    device_type = next(model.parameters()).device.type
    with torch.autocast(
        device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
    ):
        loss = setup.loss(model, batch)
    if check_finite and not bool(torch.isfinite(loss)):
        raise FloatingPointError(
            f"loss is {loss.item()}; the step was skipped, parameters unchanged"
        )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(
    setup: ZooSetup,
    steps: int,
    *,
    optimizer: OptimizerLike | None = None,
    lr: float = 1e-3,
    autocast_dtype: torch.dtype | None = None,
    on_step: Callable[[int, float], None] | None = None,
    model: nn.Module | None = None,
) -> list[float]:
    """Train `setup.model` (or `model`, e.g. a compiled or converted version of it) for
    `steps` fresh batches of `setup.train_batches()`; returns the loss of every step.

    Without `optimizer`, `make_optimizer(model, OptimizerConfig(lr=lr))`: AdamW, and
    row-wise Adagrad on tables built with `sparse_embeddings=True`.
    `on_step(step, loss)` gets the loss as a float, which syncs with the device each step.
    """
    if steps < 0:
        raise ValueError(f"steps must be non-negative, got {steps}")
    _check_autocast(autocast_dtype)
    model = setup.model if model is None else model
    if optimizer is None:
        optimizer = make_optimizer(model, OptimizerConfig(lr=lr))
    model.train()
    losses: list[torch.Tensor] = []
    batches = setup.train_batches()
    for step in range(steps):
        try:
            loss = training_step(
                setup, model, optimizer, next(batches), autocast_dtype=autocast_dtype
            )
        except FloatingPointError as error:
            raise FloatingPointError(f"step {step}: {error}") from None
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss.item())
    return [float(v) for v in torch.stack(losses).tolist()] if losses else []
