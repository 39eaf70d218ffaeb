"""Segmented multi-LoRA GEMMs: many LoRA adapters of different ranks over one token batch.

A packed batch holds the tokens of N LoRA jobs that share one frozen base linear
`y = x W^T`. Adapter i owns a contiguous token segment and adds `s_i (x A_i^T) B_i^T`,
with `A_i: [r_i, K]`, `B_i: [N_out, r_i]`, `s_i = alpha_i / r_i`. The adapters' factors are
concatenated along the rank dimension (`a_cat: [sum r, K]`, `b_cat: [N_out, sum r]`) so one
launch serves all of them (`MultiLoraLayout` says which tokens and rank rows are whose):

- `shrink`  `h[t, :r_i] = x[t] A_i^T`                (tiled over tokens and rank, loops over K)
- `expand`  `y[t] = base[t] + s_i h[t, :r_i] B_i^T`  (tiled over tokens and N_out)
- `wgrad`   `dA_i = dh_i^T x_i`, `dB_i = s_i dy_i^T h_i` (tiled over the output, loops over
  the adapter's own tokens, so adapter i's gradient never sums another adapter's tokens)

Backward: `dh = s_i dy B_i` is a shrink, `dx = dh A_i` an expand, `dA`/`dB` are wgrads
(`function`, path "unfused"). The default path "fused" runs the same op in fewer launches:
`lora_forward` (shrink + expand, h in registers), `lora_backward_data` (dh + dx) and
`lora_wgrad_split` (dA and dB of all adapters split over token chunks, then reduced).
`multi_lora_base_linear` runs the base linear and the adapters as one op (the adapters added
in place into the base GEMM's output and input gradient). Each kernel has its launcher beside it and a pure-torch reference beside
that; `multi_lora_linear` (`linear`) ties them into one autograd op. Importing this package
registers op `"multi_lora"` in `loka.kernels.registry`: `triton.multi_lora` (the kernels)
and `torch.multi_lora_loop` (the loop, anywhere).
"""

from loka.plora.kernels._launch import multi_lora_kernels_available
from loka.plora.kernels.expand import lora_expand, lora_expand_reference
from loka.plora.kernels.fused_backward import lora_backward_data, lora_backward_data_reference
from loka.plora.kernels.fused_forward import lora_forward, lora_forward_reference
from loka.plora.kernels.layout import MultiLoraLayout
from loka.plora.kernels.linear import (
    multi_lora_base_linear,
    multi_lora_linear,
    multi_lora_linear_loop,
    multi_lora_linear_reference,
)
from loka.plora.kernels.shrink import lora_shrink, lora_shrink_reference
from loka.plora.kernels.wgrad import lora_wgrad, lora_wgrad_reference
from loka.plora.kernels.wgrad_split import lora_wgrad_split, lora_wgrad_split_reference

__all__ = [
    "MultiLoraLayout",
    "lora_backward_data",
    "lora_backward_data_reference",
    "lora_expand",
    "lora_expand_reference",
    "lora_forward",
    "lora_forward_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "lora_wgrad",
    "lora_wgrad_reference",
    "lora_wgrad_split",
    "lora_wgrad_split_reference",
    "multi_lora_base_linear",
    "multi_lora_kernels_available",
    "multi_lora_linear",
    "multi_lora_linear_loop",
    "multi_lora_linear_reference",
]


def _register() -> None:
    """Op `"multi_lora"`, signature `run(x, base_out, a_cat, b_cat, layout) -> y`."""
    from loka.kernels import Backend, registry
    from loka.kernels.registry import BF16

    common = dict(
        op="multi_lora",
        reference=multi_lora_linear_loop,
        formats=frozenset({(BF16, BF16)}),
        granularities=frozenset({"none"}),
        min_capability=None,
    )
    registry.register(
        Backend(
            name="triton.multi_lora",
            run=multi_lora_linear,
            description="segmented multi-LoRA kernels: fused forward, fused dh/dx, split wgrad",
            triton=True,
            priority=1,
            **common,
        ),
        replace=True,
    )
    registry.register(
        Backend(
            name="torch.multi_lora_loop",
            run=multi_lora_linear_loop,
            description="a Python loop over the adapters with plain torch GEMMs",
            runs_on_cpu=True,
            **common,
        ),
        replace=True,
    )


_register()
