"""Real FP8 GEMMs through `torch._scaled_mm` on GPUs that have FP8 tensor cores.

Only tensorwise and rowwise scales are tried; blockwise scales and every shape or format
pair that torch refuses fall back to emulation, and the fallback is remembered so each
refusal costs one failed call per process.
"""

from __future__ import annotations

import threading

import torch

_refused: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


def has_fp8_gemm(device: torch.device) -> bool:
    """True on CUDA devices of compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    granularity: str,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """`dequant(a_q) @ dequant(b_q).T` on FP8 tensor cores, or None when torch cannot run it.

    `a_q [P, R]` and `b_q [Q, R]` are FP8 codes; `a_scale`, `b_scale` are the quantization
    scales (codes = value * scale) as `loka.probe.quantize.quantize_operand` returns them.
    """
    key = (str(a_q.dtype), str(b_q.dtype), granularity)
    if granularity not in ("tensor", "row") or key in _refused:
        return None
    p, r = a_q.shape
    q = b_q.shape[0]
    if r % 16 or q % 16 or p % 16:
        return None
    if granularity == "tensor":
        sa = a_scale.reciprocal().float().reshape(())
        sb = b_scale.reciprocal().float().reshape(())
    else:
        sa = a_scale.reciprocal().float().reshape(p, 1).contiguous()
        sb = b_scale.reciprocal().float().reshape(1, q).contiguous()
    try:
        return torch._scaled_mm(
            a_q.contiguous(), b_q.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype
        )
    except (RuntimeError, ValueError, NotImplementedError):
        with _lock:
            _refused.add(key)
        return None
