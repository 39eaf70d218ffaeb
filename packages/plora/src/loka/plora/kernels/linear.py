"""The packed multi-LoRA linear: `base_out + s_i (x A_i^T) B_i^T` on each adapter's tokens,
as the Triton autograd op, as a Python loop over adapters (the reference), and the loop
under the op's signature (the registry's CPU backend)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loka.plora.kernels.function import (
    MultiLoraBaseLinearFunction,
    MultiLoraLinearFunction,
    resolve_path,
)
from loka.plora.kernels.layout import MultiLoraLayout


def multi_lora_linear(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """`base_out + s_i (x A_i^T) B_i^T` per adapter segment, forward and backward in Triton.

    x: `[T, K]`; base_out: `[T, N]` (the frozen base linear's output, computed once for all
    adapters); a_cat: `[sum r, K]`; b_cat: `[N, sum r]`; all one dtype. Differentiable in
    x, base_out, a_cat and b_cat. `path`: "fused" (default; 4 launches per forward +
    backward) or "unfused" (the first kernels, 6 launches); None reads $LOKA_PLORA_KERNELS
    (`function.resolve_path`).
    """
    _check_linear_shapes(x, base_out.shape, a_cat, b_cat, layout)
    chosen = resolve_path(path, layout)
    return MultiLoraLinearFunction.apply(x, base_out, a_cat, b_cat, layout, chosen)


def multi_lora_base_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """`x W^T + bias + s_i (x A_i^T) B_i^T` per adapter segment: the base linear and the
    adapters as one op, so that the adapters write into the base GEMM's output and input
    gradient in place (fused kernels; less memory traffic than `F.linear` followed by
    `multi_lora_linear`). weight: `[N, K]` (frozen or not), bias `[N]` or None, x's dtype.
    a_cat `[sum r, K]`, b_cat `[N, sum r]` (any strides, e.g. a packed B^T's transpose) in
    one float dtype, x's or another: the op casts them and returns their gradients in it.
    Path "unfused" (or a rank > 128): `F.linear` then `multi_lora_linear`.
    """
    n = weight.shape[0]
    if weight.shape != (n, x.shape[1]) or weight.dtype != x.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}"
        )
    if a_cat.dtype != b_cat.dtype:
        raise TypeError(f"the factors must share one dtype, got {a_cat.dtype} and {b_cat.dtype}")
    if resolve_path(path, layout) != "fused":
        base = torch.nn.functional.linear(x, weight, bias)
        return multi_lora_linear(
            x, base, a_cat.to(x.dtype), b_cat.to(x.dtype), layout, path="unfused"
        )
    _check_linear_shapes(x, (x.shape[0], n), a_cat, b_cat, layout)
    return MultiLoraBaseLinearFunction.apply(x, weight, bias, a_cat, b_cat, layout)


def multi_lora_linear_reference(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_list: Sequence[torch.Tensor],
    b_list: Sequence[torch.Tensor],
    layout: MultiLoraLayout,
) -> torch.Tensor:
    """The same result as a Python loop over adapters (differentiable, plain torch ops).

    Takes the per-adapter factors `A_i: [r_i, K]`, `B_i: [N, r_i]` rather than the
    concatenation; this is also the "loop" baseline the benchmark compares against.
    """
    if len(a_list) != layout.num_adapters or len(b_list) != layout.num_adapters:
        raise ValueError(
            f"expected {layout.num_adapters} adapters, got {len(a_list)} A and {len(b_list)} B"
        )
    order = sorted(range(layout.num_adapters), key=lambda i: layout.token_starts[i])
    pieces = []
    for i in order:
        s, e = layout.token_starts[i], layout.token_ends[i]
        if s == e:
            continue
        delta = (x[s:e] @ a_list[i].t()) @ b_list[i].t()
        pieces.append(base_out[s:e] + delta * layout.scales[i])
    return torch.cat(pieces)


def _check_linear_shapes(x, base_shape, a_cat, b_cat, layout: MultiLoraLayout) -> None:
    t, k = x.shape
    if base_shape[0] != t:
        raise ValueError(f"x has {t} tokens but base_out {base_shape[0]}")
    if a_cat.shape != (layout.total_rank, k):
        raise ValueError(
            f"a_cat shape {tuple(a_cat.shape)} != (sum of ranks {layout.total_rank}, K {k})"
        )
    if b_cat.shape != (base_shape[1], layout.total_rank):
        raise ValueError(
            f"b_cat shape {tuple(b_cat.shape)} != (N {base_shape[1]}, "
            f"sum of ranks {layout.total_rank})"
        )


def multi_lora_linear_loop(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
) -> torch.Tensor:
    """`multi_lora_linear`'s signature over the Python loop (differentiable torch ops)."""
    _check_linear_shapes(x, base_out.shape, a_cat, b_cat, layout)
    a_list = [a_cat[o : o + r] for o, r in zip(layout.rank_offsets, layout.ranks, strict=True)]
    b_list = [b_cat[:, o : o + r] for o, r in zip(layout.rank_offsets, layout.ranks, strict=True)]
    return multi_lora_linear_reference(x, base_out, a_list, b_list, layout)
