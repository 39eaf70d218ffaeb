"""Where a kernel can run: a CUDA GPU with FP8 tensor cores, or Triton's CPU interpreter."""

from __future__ import annotations

import os

import torch

__all__ = [
    "autotuning",
    "capability",
    "cdiv",
    "interpreting",
    "next_pow2",
    "require_triton_device",
]

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


# Triton decides between compiling and interpreting when a kernel is defined, i.e. when
# loka.kernels is imported; later changes of TRITON_INTERPRET do not apply to our kernels.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when our kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 was set
    before loka.kernels was imported)."""
    return _INTERPRETING


def autotuning() -> bool:
    """False when LOKA_KERNELS_AUTOTUNE=0: GEMMs then launch one heuristic tile instead of
    timing every candidate (a fast first compile, e.g. for a quick correctness run)."""
    return os.environ.get("LOKA_KERNELS_AUTOTUNE", "1") not in ("0", "")


# Plain-Python twins of triton.cdiv and triton.next_power_of_2: those are constexpr functions
# whose host calls cost microseconds each, paid on every launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def aligned(t: torch.Tensor) -> bool:
    """Whether a tensor's data is 16-byte aligned (Triton specializes kernels on it)."""
    return t.data_ptr() % 16 == 0


def capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, or None when the device is not a CUDA GPU."""
    device = resolve_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    return torch.device(device)


def triton_unavailable_reason(
    device: torch.device, min_capability: tuple[int, int] | None
) -> str | None:
    """Why a Triton kernel cannot run on `device` (None when it can)."""
    if device.type == "cpu":
        if interpreting():
            return None
        return "Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before importing loka.kernels"
    if device.type != "cuda":
        return f"Triton kernels do not run on {device.type}"
    cap = capability(device)
    if min_capability is not None and cap is not None and cap < min_capability:
        return f"needs compute capability {min_capability[0]}.{min_capability[1]}+, device has {cap[0]}.{cap[1]}"
    return None


# (device, min_capability) -> reason, for CUDA devices: a GPU's capability never changes, and
# asking the driver on every launch costs microseconds that quantization kernels do not take.
_CUDA_REASONS: dict[tuple[torch.device, tuple[int, int] | None], str | None] = {}


def require_triton_device(
    *tensors: torch.Tensor, min_capability: tuple[int, int] | None = None
) -> None:
    """Raise a clear error unless all tensors share one device a Triton kernel can run on."""
    if len(tensors) == 1:
        device = tensors[0].device
    else:
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"tensors must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
    if device.type == "cuda":
        key = (device, min_capability)
        try:
            reason = _CUDA_REASONS[key]
        except KeyError:
            reason = _CUDA_REASONS[key] = triton_unavailable_reason(device, min_capability)
    else:
        reason = triton_unavailable_reason(device, min_capability)
    if reason is not None:
        raise RuntimeError(reason)


if interpreting():
    from loka.kernels import _interpreter_compat

    _interpreter_compat.apply()
