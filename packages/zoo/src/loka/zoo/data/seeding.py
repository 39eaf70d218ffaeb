"""Per-batch random generators: batch i of a stream is the same whatever was drawn before."""

from __future__ import annotations

import torch

__all__ = [
    "CALIBRATION_STREAM",
    "SPLIT_STREAMS",
    "TEST_STREAM",
    "TRAIN_STREAM",
    "VALID_STREAM",
    "generator",
    "split_stream",
    "stream_seed",
]

TRAIN_STREAM = 0
VALID_STREAM = 1
TEST_STREAM = 2
CALIBRATION_STREAM = 3
SPLIT_STREAMS = {"valid": VALID_STREAM, "test": TEST_STREAM}

_MASK = (1 << 63) - 1


def stream_seed(seed: int, stream: int, index: int) -> int:
    """Mix (seed, stream, index) into one 63-bit seed (splitmix64 finalizer)."""
    z = (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + index) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


def generator(device: torch.device, seed: int, stream: int, index: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(stream_seed(seed, stream, index))
    return g


def split_stream(split: str) -> int:
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {sorted(SPLIT_STREAMS)}, got {split!r}")
    return SPLIT_STREAMS[split]


def zipf_ids(
    uniform: torch.Tensor, sizes: torch.Tensor | int, alpha: torch.Tensor | float
) -> torch.Tensor:
    """Power-law ids in `[0, size)` by inverting a continuous Zipf(alpha) CDF on [1, size+1).

    `P(id = k) ~ (k + 1) ** -alpha`; `alpha` must differ from 1. Plain numbers stay on the
    host (a device scalar would cost a copy per batch).
    """
    one_minus = 1.0 - (alpha.double() if isinstance(alpha, torch.Tensor) else float(alpha))
    size = sizes.double() if isinstance(sizes, torch.Tensor) else float(sizes)
    top = (size + 1.0) ** one_minus
    x = (1.0 + uniform.double() * (top - 1.0)) ** (1.0 / one_minus)
    ids = x.floor().long() - 1
    upper = sizes.long() - 1 if isinstance(sizes, torch.Tensor) else int(sizes) - 1
    return torch.clamp(ids.clamp_min(0), max=upper)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a sync: a copy from pageable memory would wait for the stream."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
