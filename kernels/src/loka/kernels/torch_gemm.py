"""GEMMs from torch's own libraries: bf16 ``F.linear`` and FP8 ``torch._scaled_mm`` (cuBLASLt
for tensorwise scales, CUTLASS for rowwise), wrapped with the registry's uniform signature."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loka.kernels.epilogue import apply_epilogue, check_bias
from loka.kernels.formats import check_activation, check_high_precision_2d, check_out_dtype
from loka.kernels.fp8_gemm import check_fp8_request
from loka.kernels.fp8_tensor import Fp8Tensor


def bf16_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``activation(a @ b.T + bias)`` with ``F.linear`` in the operands' dtype (the baseline)."""
    check_high_precision_2d(a, "a")
    check_high_precision_2d(b, "b")
    check_activation(activation)
    check_out_dtype(out_dtype)
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a is [M, K] = {tuple(a.shape)} and b is [N, K] = {tuple(b.shape)}: K differs"
        )
    if a.dtype != b.dtype:
        raise TypeError(f"a is {a.dtype} and b is {b.dtype}: use one dtype")
    bias = check_bias(bias, b.shape[0], a.device)
    y = F.linear(a, b, None if bias is None else bias.to(a.dtype))
    return apply_epilogue(y, None, activation).to(out_dtype)


# torch.compile's inductor pads a bf16 matmul's dims to multiples of 8 (16 bytes) where it
# measures the padded GEMM faster (`torch._inductor.fx_passes.pad_mm`).
INDUCTOR_BF16_ALIGN = 8


def padded_bf16_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`bf16_mm` with M, K and N zero-padded to multiples of `INDUCTOR_BF16_ALIGN` and the
    result sliced back: the GEMM a compiled model runs at an unaligned shape (exact, since
    the padding is zeros)."""
    m, n = a.shape[0], b.shape[0]
    pad = [(-d) % INDUCTOR_BF16_ALIGN for d in (m, a.shape[1], n)]
    if any(pad):
        a = F.pad(a, (0, pad[1], 0, pad[0]))
        b = F.pad(b, (0, pad[1], 0, pad[2]))
        if bias is not None:
            bias = F.pad(bias, (0, pad[2]))
    y = bf16_mm(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
    return y[:m, :n] if any(pad) else y


def scaled_mm_refusal(
    a_fmt: str, b_fmt: str, granularity: str, out_dtype: torch.dtype
) -> str | None:
    """What torch._scaled_mm (torch 2.11, sm_89+) rejects, as a reason; None if it runs."""
    if granularity == "row":
        if b_fmt != "e4m3":
            return "torch._scaled_mm rowwise needs an e4m3 second operand"
        if out_dtype != torch.bfloat16:
            return "torch._scaled_mm rowwise writes bfloat16 only"
    elif granularity == "tensor":
        if a_fmt == b_fmt == "e5m2":
            return "torch._scaled_mm (cuBLASLt) does not multiply e5m2 by e5m2"
    else:
        return f"torch._scaled_mm backend takes tensor or row scales, not {granularity!r}"
    return None


def scaled_mm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``activation(dequant(a) @ dequant(b).T + bias)`` through ``torch._scaled_mm``.

    A bf16 bias with bf16 output is fused into the GEMM; other biases and the activation run
    as separate torch ops after it.
    """
    bias = check_fp8_request(a, b, bias, activation, out_dtype)
    if a.granularity != b.granularity:
        raise ValueError(
            f"torch._scaled_mm needs one granularity, got {a.granularity} and {b.granularity}"
        )
    reason = scaled_mm_refusal(a.fmt, b.fmt, a.granularity, out_dtype)
    if reason is not None:
        raise ValueError(reason)
    if a.granularity == "tensor":
        scale_a, scale_b = a.inv_scale, b.inv_scale
    else:
        scale_a, scale_b = a.inv_scale.view(-1, 1), b.inv_scale.view(1, -1)
    fuse_bias = bias is not None and bias.dtype == out_dtype == torch.bfloat16
    y = torch._scaled_mm(
        a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b,
        bias=bias if fuse_bias else None, out_dtype=out_dtype, use_fast_accum=fast_accum,
    )  # fmt: skip
    return apply_epilogue(y, None if fuse_bias else bias, activation)
