"""The LoRDBA branch as an autograd function: sign-GEMM kernels forward and backward.

Forward, for ``x: [M, K]`` and the base output ``y: [M, N]``::

    t   = (x * q) @ sign(A)^T                     sign_down   [M, r] float32, saved
    out = y + s * p * ((t * m) @ sign(B)^T)       sign_up     (the add is fused)

Backward, with ``g = dL/d out``::

    g_u = (g * s p) @ sign(B)                     sign_down   [M, r]
    dm  = sum_M g_u * t
    dx  = q * ((g_u * m) @ sign(A))               sign_up
    dA_latent, dq = STE(q * (g_u m)^T x), sum_r   sign_wgrad
    dB_latent, dp = STE(s p * g^T (t m)), sum_r   sign_wgrad

``g`` also flows unchanged to ``y``, so the base's own backward adds its input gradient.
Latent factors only ever enter through their signs, packed 8 per byte before each use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from loka.lordba.kernels import (
    linear_sign_up,
    pack_signs,
    sign_adapter,
    sign_down,
    sign_down_reference,
    sign_up,
    sign_up_reference,
    sign_wgrad,
    sign_wgrad_reference,
)
from loka.mods.dtypes import cast


class SignOps(NamedTuple):
    """One implementation of the three sign-GEMM ops (the kernels, or their references), and
    the fused inference forwards where they exist (``sign_adapter``: down + rank scale + up in
    one launch; ``linear_sign_up``: the base GEMM with the up-projection in its epilogue; the
    references have neither, their two ops are the fallback)."""

    down: Callable[..., Any]
    up: Callable[..., Any]
    wgrad: Callable[..., Any]
    fused: Callable[..., Any] | None = None
    epilogue: Callable[..., Any] | None = None


TRITON_OPS = SignOps(sign_down, sign_up, sign_wgrad, sign_adapter, linear_sign_up)
TORCH_OPS = SignOps(sign_down_reference, sign_up_reference, sign_wgrad_reference)


def select_ops(backend: str, device: torch.device) -> SignOps:
    """``auto``: the Triton kernels on CUDA, the pure-torch references elsewhere. Under
    torch.compile always the references, which trace whole and which inductor fuses: Dynamo
    traced the sign-GEMM kernels as user Triton kernels and inductor's recompile of them
    failed (H200: "CompilationError" at the kernel's ``mma``; `bench/lordba_compile.py`)."""
    if torch.compiler.is_compiling():
        return TORCH_OPS
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        return TRITON_OPS
    return TORCH_OPS


class PackedSigns(NamedTuple):
    """``a``: sign(A) as ``[r, ceil(K/8)]``; ``b``: sign(B)^T as ``[r, ceil(N/8)]``."""

    a: torch.Tensor
    b: torch.Tensor


def pack_factor_signs(latent_a: torch.Tensor, latent_b: torch.Tensor) -> PackedSigns:
    return PackedSigns(pack_signs(latent_a.detach()), pack_signs(latent_b.detach().t()))


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None or like is None else cast(grad, like.dtype)


class LoRDBAFunction(torch.autograd.Function):
    """``y + adapter(x)``; see the module docstring for the formulas."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        base_out: torch.Tensor,
        latent_a: torch.Tensor,
        latent_b: torch.Tensor,
        scale_in: torch.Tensor | None,
        scale_rank: torch.Tensor,
        scale_out: torch.Tensor,
        scaling: float,
        clip_a: float,
        clip_b: float,
        packed_a: torch.Tensor,
        packed_b: torch.Tensor,
        ops: SignOps,
    ) -> torch.Tensor:
        packed = PackedSigns(packed_a, packed_b)
        t = ops.down(x, packed.a, scale_in)
        out = ops.up(
            t,
            packed.b,
            base_out.shape[1],
            row_scale=scale_rank,
            col_scale=scale_out,
            alpha=scaling,
            addend=base_out,
        )
        ctx.save_for_backward(
            x, t, latent_a, latent_b, scale_in, scale_rank, scale_out, packed_a, packed_b
        )
        ctx.ops = ops
        ctx.scaling, ctx.clip_a, ctx.clip_b = scaling, clip_a, clip_b
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, t, latent_a, latent_b, scale_in, scale_rank, scale_out, *signs = ctx.saved_tensors
        ops, packed, scaling = ctx.ops, PackedSigns(*signs), ctx.scaling
        needs = ctx.needs_input_grad
        grad_u = ops.down(grad_out, packed.b, scale_out * scaling)
        grad_x = grad_a = grad_b = grad_in = grad_rank = grad_out_scale = None
        if needs[0]:
            grad_x = ops.up(
                grad_u,
                packed.a,
                x.shape[1],
                row_scale=scale_rank,
                col_scale=scale_in,
                out_dtype=x.dtype,
            )
        if needs[5]:
            grad_rank = (grad_u * t).sum(dim=0)
        if needs[2] or needs[4]:
            grad_a, grad_in = ops.wgrad(
                grad_u * scale_rank, x, latent_a, col_scale=scale_in, clip=ctx.clip_a
            )
        if needs[3] or needs[6]:
            grad_b_t, grad_out_scale = ops.wgrad(
                t * scale_rank,
                grad_out,
                latent_b.t(),
                col_scale=scale_out,
                alpha=scaling,
                clip=ctx.clip_b,
            )
            grad_b = grad_b_t.t()
        return (
            grad_x,
            grad_out if needs[1] else None,
            grad_a if needs[2] else None,
            grad_b if needs[3] else None,
            _cast(grad_in, scale_in) if needs[4] else None,
            _cast(grad_rank, scale_rank),
            _cast(grad_out_scale, scale_out) if needs[6] else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
