"""Bit-packed sign matrices: host-side packing and the in-register unpacking used by the kernels.

Layout (shared by every sign-GEMM kernel and by LoRDBA's storage): a sign matrix ``S`` of shape
``[rows, length]`` with entries +-1 is stored as ``uint8[rows, ceil(length / 8)]``. Bit ``j``
(least significant first) of byte ``c`` holds element ``8 * c + j``; a set bit means -1, like
an IEEE sign bit, so an all-zero tensor is all +1 and ``sign(0) = +1``. Padding bits past
``length`` are zero. Packing along the long axis keeps each row's bytes contiguous, which is
what a kernel tile walking that axis loads.
"""

from __future__ import annotations

import torch

SIGNS_PER_BYTE = 8

_BIT_WEIGHTS = tuple(1 << bit for bit in range(SIGNS_PER_BYTE))


def packed_length(length: int) -> int:
    """Bytes per row of a packed sign matrix whose rows have ``length`` signs."""
    return (length + SIGNS_PER_BYTE - 1) // SIGNS_PER_BYTE


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Pack the signs of a 2-D float tensor ``[rows, length]`` into ``uint8[rows, ceil(length/8)]``.

    Negative entries become set bits (-1); zero and positive entries become clear bits (+1).
    Works on any view (e.g. the transpose of a parameter) and on any device.
    """
    if values.dim() != 2:
        raise ValueError(f"pack_signs expects a 2-D tensor, got shape {tuple(values.shape)}")
    if not values.is_floating_point():
        raise TypeError(f"pack_signs expects a floating-point tensor, got {values.dtype}")
    rows, length = values.shape
    pad = packed_length(length) * SIGNS_PER_BYTE - length
    negative = values < 0
    if pad:
        negative = torch.nn.functional.pad(negative, (0, pad))
    bits = negative.reshape(rows, -1, SIGNS_PER_BYTE).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=values.device)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(
    packed: torch.Tensor, length: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a ``[rows, length]`` tensor of +-1 in ``dtype``."""
    if packed.dim() != 2:
        raise ValueError(f"packed signs must be 2-D, got shape {tuple(packed.shape)}")
    check_packed_signs(packed, packed.shape[0], length)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    bits = bits.reshape(packed.shape[0], -1)[:, :length]
    one = torch.ones((), dtype=dtype, device=packed.device)
    return torch.where(bits, -one, one)


def check_packed_signs(
    packed: torch.Tensor, rows: int, length: int, name: str = "packed signs"
) -> None:
    """Raise a clear error unless ``packed`` is a valid ``[rows, ceil(length/8)]`` sign tensor.

    Checks dtype, shape and contiguity (cheap, no device sync). Padding bits are checked by
    :func:`check_padding_bits`, which reads the data.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name}: packed signs must be torch.uint8, got {packed.dtype}")
    expected = (rows, packed_length(length))
    if packed.dim() != 2 or tuple(packed.shape) != expected:
        raise ValueError(
            f"{name}: expected shape {expected} (rows={rows}, {length} signs per row packed "
            f"{SIGNS_PER_BYTE} per byte), got {tuple(packed.shape)}"
        )
    if packed.stride(-1) != 1 or (rows > 1 and packed.stride(0) != expected[1]):
        raise ValueError(f"{name}: packed signs must be contiguous, got strides {packed.stride()}")


def check_padding_bits(packed: torch.Tensor, length: int, name: str = "packed signs") -> None:
    """Raise if any padding bit past ``length`` is set: such a tensor was corrupted or mis-sized."""
    used_bits = length % SIGNS_PER_BYTE
    if used_bits == 0 or packed.numel() == 0:
        return
    stray = packed[:, -1] >> used_bits
    if bool((stray != 0).any()):
        raise ValueError(
            f"{name}: padding bits past sign {length} are set; the tensor is corrupted or was "
            f"packed for a different length"
        )
