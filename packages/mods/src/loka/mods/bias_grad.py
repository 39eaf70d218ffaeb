"""A linear's bias gradient, ``dY`` summed over its tokens, in one of three forms.

"sum": ``dY.sum(0)``, a column reduction over the tokens M (what `nn.Linear` does).
"gemm": ``ones[1, M] @ dY``, the same sum on the tensor cores, accumulated as the GEMM
accumulates (float32 within a tile; a bf16 GEMM's split-K partials may be added in bf16
while `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` is True, torch's
default), rounded to dY's dtype as the reduction is.
"split": the sum in two stages, float32 (or wider) partial sums over blocks of `SPLIT_ROWS`
tokens (the last block zero-padded), then over the blocks, rounded once: the sum with another
order of additions. Under torch.compile with jagged batches M is symbolic and inductor does not split
a reduction over it; fused with the elementwise work that produces dY it then runs as one
serial loop over M per column block: HSTU xl's uvqk backward kernel read 0.8 GB in 2.6 ms
(bf16) and 3.4 ms (beside an FP8 quantization) on the H200. Split by hand, the first stage
has M / `SPLIT_ROWS` times the parallelism whatever M is. In eager mode it is "sum" (ATen's
reduction splits by itself; the padding would copy dY).

Which form wins in place is a benchmark question (`bench/bias_grad_layer.py`,
`bench/realized.py` variants ``loka+bias=...``). One HSTU xl layer, compiled, on the H200
(`bench/results/bias_grad_layer_20261203T224917Z.json`): in bf16, "split" or "gemm" turn the
2.46 ms reduction kernel into a 1.17 ms pointwise one (layer 1.026x / 1.018x); with the plan's
FP8 dgrad (row scales) and a bf16 wgrad, dY's row amax keeps that kernel a looped reduction
(3.15 ms) and "split" gains 1.4% of the layer ("gemm" loses 1.1%); with uvqk's wgrad in FP8
too, "split" loses 8% (the column sum had ridden in a persistent kernel with the tensor amax).
So "sum" stays the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

BIAS_GRADS = ("sum", "gemm", "split")
SPLIT_ROWS = 256


def bias_gradient(dy: torch.Tensor, method: str) -> torch.Tensor:
    """``dY`` summed over its token dim: dim 0 of a 2-D ``[M, N]``, dim 1 of a grouped
    ``[G, M, N]``."""
    tokens = dy.dim() - 2
    if method == "sum" or (method == "split" and not torch.compiler.is_compiling()):
        return dy.sum(tokens)
    if method == "split":
        return _split_sum(dy, tokens)
    if method != "gemm":
        raise ValueError(f"bias_grad must be one of {BIAS_GRADS}, got {method!r}")
    if dy.dim() == 2:
        return (dy.new_ones(1, dy.shape[0]) @ dy)[0]
    return torch.bmm(dy.new_ones(dy.shape[0], 1, dy.shape[1]), dy)[:, 0]


def _split_sum(dy: torch.Tensor, tokens: int) -> torch.Tensor:
    """`dy` summed over dim `tokens` through float32 partial sums of `SPLIT_ROWS` rows."""
    M, N = dy.shape[tokens], dy.shape[-1]
    pad = (-M) % SPLIT_ROWS
    if not statically_known_true(pad == 0):  # no guard on a symbolic M: always padded
        dy = F.pad(dy, (0, 0, 0, pad))
    blocks = dy.reshape(*dy.shape[:tokens], -1, SPLIT_ROWS, N)
    partial = blocks.sum(tokens + 1, dtype=torch.promote_types(dy.dtype, torch.float32))
    return partial.sum(tokens).to(dy.dtype)
