"""Dtype casts inside LoKA's autograd functions."""

from __future__ import annotations

import torch

__all__ = ["cast"]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, without a call when it already is.

    Not a style choice: under torch.compile with autocast on (torch 2.11), an
    autograd.Function whose forward returns the result of a no-op ``.to(dtype)`` gets zero
    gradients for every input and for everything upstream, silently (eager is right). The
    FP8 GEMMs write bf16 and autocast computes in bf16, so every FP8 linear's output went
    through such a ``.to``. `tests`: compiled-vs-eager gradient checks under autocast.
    """
    return t if t.dtype == dtype else t.to(dtype)
