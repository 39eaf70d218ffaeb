"""Wukong-style stack (after Zang et al. 2024, "Wukong: Towards a Scaling Law for
Large-Scale Recommendation").

The n feature embeddings `[B, n, d]` (the categorical tables plus the dense features'
bottom-MLP vector) go through layers of a factorization-machine block (FMB) and a linear
compression block (LCB), concatenated, added to a residual and normalized over d:
- FMB: `X (X^T W)` with W a Linear(n, k) (the rank-k optimized FM), flattened, norm ->
  Linear -> activation -> Linear to `fm_outputs` embeddings;
- LCB: a Linear(n, `lcb_outputs`) mixing embeddings.
Several of these GEMMs are deliberately skinny (K or N = n or k, tens), as in the paper.

`lcb_layout` says how the LCB mixes embeddings. "linear" (the default): an `nn.Linear(n, o)`
over the transposed `[B, d, n]` view, so its output is `[B, o, d]` with d strided, and the
layer's LayerNorm over d (with the concatenation and residual inductor fuses into it) reads
and, in the backward, writes it strided: in the compiled Wukong xl step those kernels took
~21 ms of 71 ms of GPU time (H200 profile, `bench/results/profiles_wukong_xl_20261202T0618Z`).
"bmm": the weight applied from the left, `W @ X_b` for every example as one batched matmul
(`torch.bmm` over the expanded weight; `torch.matmul` would fold it back into the transposed
form), so the output is `[B, o, d]` contiguous; the weight is then a parameter of the block,
not an `nn.Linear` (no site for Probe: these GEMMs, K = n, N = o, are never FP8 candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loka.zoo.layers import make_activation, make_norm, mlp
from loka.zoo.models.features import CTRStackConfig, FeatureInputs, require_positive


@dataclass(frozen=True)
class WukongConfig(CTRStackConfig):
    fm_outputs: int = 4
    lcb_outputs: int = 4
    fm_rank: int = 8
    fm_hidden: int = 64
    lcb_layout: str = "linear"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "fm_outputs", "lcb_outputs", "fm_rank", "fm_hidden")
        if self.lcb_layout not in LCB_LAYOUTS:
            raise ValueError(f"lcb_layout must be one of {LCB_LAYOUTS}, got {self.lcb_layout!r}")


LCB_LAYOUTS = ("linear", "bmm")


class FactorizationMachineBlock(nn.Module):
    def __init__(self, config: WukongConfig, num_inputs: int) -> None:
        super().__init__()
        flat = num_inputs * config.fm_rank
        self.outputs, self.dim = config.fm_outputs, config.embedding_dim
        self.compress = nn.Linear(num_inputs, config.fm_rank, bias=False)
        self.mlp = nn.Sequential(
            make_norm(config.norm, flat),
            nn.Linear(flat, config.fm_hidden),
            make_activation(config.activation),
            nn.Linear(config.fm_hidden, config.fm_outputs * config.embedding_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compressed = self.compress(x.transpose(1, 2))  # [B, d, k]
        interactions = torch.bmm(x.to(compressed.dtype), compressed)  # [B, n, k]
        return self.mlp(interactions.flatten(1)).view(-1, self.outputs, self.dim)


class LinearCompressionBlock(nn.Module):
    """`[B, n, d] -> [B, o, d]`: `W @ X_b`, W `[o, n]` (module docstring: `layout`)."""

    def __init__(self, num_inputs: int, num_outputs: int, layout: str = "linear") -> None:
        super().__init__()
        self.layout = layout
        compress = nn.Linear(num_inputs, num_outputs, bias=False)
        if layout == "linear":
            self.compress = compress
        else:  # the same initialization, held by the block
            self.weight = nn.Parameter(compress.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "linear":
            return self.compress(x.transpose(1, 2)).transpose(1, 2)
        weight = self.weight
        if torch.is_autocast_enabled(x.device.type):
            weight = weight.to(torch.get_autocast_dtype(x.device.type))
        return torch.bmm(weight.expand(x.shape[0], -1, -1), x.to(weight.dtype))


class WukongLayer(nn.Module):
    def __init__(self, config: WukongConfig, num_inputs: int) -> None:
        super().__init__()
        num_outputs = config.fm_outputs + config.lcb_outputs
        self.fmb = FactorizationMachineBlock(config, num_inputs)
        layout = config.lcb_layout
        self.lcb = LinearCompressionBlock(num_inputs, config.lcb_outputs, layout)
        # The residual needs its own compression when the embedding count changes.
        self.residual = (
            LinearCompressionBlock(num_inputs, num_outputs, layout)
            if num_inputs != num_outputs
            else None
        )
        self.norm = make_norm(config.norm, config.embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([self.fmb(x), self.lcb(x)], dim=1)
        residual = x if self.residual is None else self.residual(x)
        return self.norm(out + residual)


class Wukong(nn.Module):
    """`forward(batch) -> logits [B]` from `batch["dense"]` and `batch["sparse"]`."""

    def __init__(self, config: WukongConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.inputs = FeatureInputs(config)
        inputs = config.num_sparse + 1
        outputs = config.fm_outputs + config.lcb_outputs
        self.layers = nn.ModuleList(
            WukongLayer(config, inputs if i == 0 else outputs) for i in range(config.num_layers)
        )
        self.head = mlp(outputs * dim, (*config.head_widths, 1), activate_last=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dense_vector, pooled = self.inputs(batch)
        x = torch.cat([dense_vector.unsqueeze(1), pooled], dim=1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.flatten(1)).squeeze(-1)
