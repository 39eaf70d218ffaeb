"""When a weight's FP8 copies are stale.

A weight's version counter moves with every autograd-visible in-place update, but not with
all updates: torch's fused optimizers (`AdamW(fused=True)`) and writes through `.data` leave
it where it was. So every optimizer step also advances a process-wide generation (through a
global optimizer step hook), and a weight's stamp holds its version, its storage and that
generation. Frozen weights (`requires_grad=False`, a LoRA base model) are no optimizer's
business, so their stamp skips that generation and their copies survive every step. Code
that rewrites weights outside any optimizer step through `.data` calls
`invalidate_weight_caches()`.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = [
    "invalidate_weight_caches",
    "weight_stamp",
]

_step_generation = 0
_manual_generation = 0


def _advance(*_: object) -> None:
    global _step_generation
    _step_generation += 1


register_optimizer_step_post_hook(_advance)


def weight_stamp(weight: torch.Tensor) -> tuple[int, int, int]:
    """What must change for a weight's cached FP8 copies to be re-made."""
    steps = _step_generation if weight.requires_grad else 0
    return (weight._version, weight.data_ptr(), steps + (_manual_generation << 32))


def invalidate_weight_caches() -> None:
    """Mark every cached FP8 weight copy stale (after an update that no optimizer made)."""
    global _manual_generation
    _manual_generation += 1
