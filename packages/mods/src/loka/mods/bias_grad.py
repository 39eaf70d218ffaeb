"""A linear's bias gradient, ``dY`` summed over its tokens, in one of two forms.

"sum": ``dY.sum(0)``, a column reduction over the tokens M (what `nn.Linear` does).
"gemm": ``ones[1, M] @ dY``, the same sum on the tensor cores, accumulated as the GEMM
accumulates (float32 within a tile; a bf16 GEMM's split-K partials may be added in bf16
while `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` is True, torch's
default), rounded to dY's dtype as the reduction is. Under torch.compile with jagged batches M is
symbolic and inductor does not split a reduction over it: HSTU xl's bias-gradient kernel
read 0.8 GB in 2.6 ms (bf16) and 3.4 ms (beside an FP8 quantization) on the H200, where a
GEMM reads dY at bandwidth. Which form wins in place is a benchmark question
(`bench/native_dynamic.py --sections bias`, `bench/realized.py` variant ``loka+bias=gemm``);
"sum" stays the default until one says otherwise.
"""

from __future__ import annotations

import torch

BIAS_GRADS = ("sum", "gemm")


def bias_gradient(dy: torch.Tensor, method: str) -> torch.Tensor:
    """``dY`` summed over its token dim: dim 0 of a 2-D ``[M, N]``, dim 1 of a grouped
    ``[G, M, N]``."""
    if method == "sum":
        return dy.sum(dy.dim() - 2)
    if method != "gemm":
        raise ValueError(f"bias_grad must be one of {BIAS_GRADS}, got {method!r}")
    if dy.dim() == 2:
        return (dy.new_ones(1, dy.shape[0]) @ dy)[0]
    return torch.bmm(dy.new_ones(dy.shape[0], 1, dy.shape[1]), dy)[:, 0]
