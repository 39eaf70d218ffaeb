"""Wukong-style stack (after Zang et al. 2024, "Wukong: Towards a Scaling Law for
Large-Scale Recommendation").

The n feature embeddings `[B, n, d]` (the categorical tables plus the dense features'
bottom-MLP vector) go through layers of a factorization-machine block (FMB) and a linear
compression block (LCB), concatenated, added to a residual and normalized over d:
- FMB: `X (X^T W)` with W a Linear(n, k) (the rank-k optimized FM), flattened, norm ->
  Linear -> activation -> Linear to `fm_outputs` embeddings;
- LCB: a Linear(n, `lcb_outputs`) mixing embeddings.
Several of these GEMMs are deliberately skinny (K or N = n or k, tens), as in the paper.

`mixing` says how the blocks mix the n embeddings (the FMB's compression `X^T W` and the
LCB). "linear" (the default; the xl preset uses "bmm"): `nn.Linear`s over the transposed
`[B, d, n]` view, so the LCB's output `[B, o, d]` has d strided and both blocks hand the
layer's input a transposed gradient; the LayerNorms over d, with the concatenation, residual and gradient sums inductor
fuses into them, then read and write with a stride of o or n: in the compiled Wukong xl step
those kernels took ~21 ms of 71 ms of GPU time (H200 profile,
`bench/results/profiles_wukong_xl_20261202T0618Z`). "bmm": the weights applied from the
left, `W @ X_b` for every example as one batched matmul over the expanded weight
(`torch.matmul` would fold it back into the transposed form), so every output and input
gradient is contiguous `[B, *, d]`; the weights are then parameters of the blocks
(`compress_weight`), not `nn.Linear`s: no sites for Probe (these GEMMs, K = n or N = k, o,
are never FP8 candidates).
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
    mixing: str = "linear"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "fm_outputs", "lcb_outputs", "fm_rank", "fm_hidden")
        if self.mixing not in MIXINGS:
            raise ValueError(f"mixing must be one of {MIXINGS}, got {self.mixing!r}")


MIXINGS = ("linear", "bmm")


class EmbeddingMix(nn.Module):
    """A block whose `mix(x)` is `[B, n, d] -> [B, o, d]`, `W @ X_b` with W `[o, n]`, laid out
    as `mixing` says (module docstring): W is `compress` (an `nn.Linear`, "linear") or
    `compress_weight` ("bmm"). `mix(x, transposed=True)` returns `[B, d, o]`."""

    def __init__(self, num_inputs: int, num_outputs: int, mixing: str = "linear") -> None:
        super().__init__()
        self.mixing = mixing
        compress = nn.Linear(num_inputs, num_outputs, bias=False)
        if mixing == "linear":
            self.compress = compress
        else:  # the same initialization, held by the block
            self.compress_weight = nn.Parameter(compress.weight.detach())

    def mix(self, x: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        if self.mixing == "linear":
            out = self.compress(x.transpose(1, 2))  # [B, d, o]
            return out if transposed else out.transpose(1, 2)
        weight = self.compress_weight
        # meta (loka.zoo.estimate) has no autocast to ask about; torch.amp's
        # is_autocast_available would do, but dynamo cannot trace it (a graph break per
        # block: Wukong xl's compiled bf16 step 59 -> 72 ms with 11 graphs).
        kind = x.device.type
        if kind != "meta" and torch.is_autocast_enabled(kind):
            weight = weight.to(torch.get_autocast_dtype(x.device.type))
        out = torch.bmm(weight.expand(x.shape[0], -1, -1), x.to(weight.dtype))  # [B, o, d]
        return out.transpose(1, 2) if transposed else out


class FactorizationMachineBlock(EmbeddingMix):
    def __init__(self, config: WukongConfig, num_inputs: int) -> None:
        super().__init__(num_inputs, config.fm_rank, config.mixing)
        flat = num_inputs * config.fm_rank
        self.outputs, self.dim = config.fm_outputs, config.embedding_dim
        self.mlp = nn.Sequential(
            make_norm(config.norm, flat),
            nn.Linear(flat, config.fm_hidden),
            make_activation(config.activation),
            nn.Linear(config.fm_hidden, config.fm_outputs * config.embedding_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compressed = self.mix(x, transposed=True)  # [B, d, k] (for "bmm" a view of [B, k, d])
        interactions = torch.bmm(x.to(compressed.dtype), compressed)  # [B, n, k]
        return self.mlp(interactions.flatten(1)).view(-1, self.outputs, self.dim)


class LinearCompressionBlock(EmbeddingMix):
    """The LCB: `Linear(n, n_L)` over the embedding axis (`EmbeddingMix`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)


class WukongLayer(nn.Module):
    def __init__(self, config: WukongConfig, num_inputs: int) -> None:
        super().__init__()
        num_outputs = config.fm_outputs + config.lcb_outputs
        self.fmb = FactorizationMachineBlock(config, num_inputs)
        self.lcb = LinearCompressionBlock(num_inputs, config.lcb_outputs, config.mixing)
        # The residual needs its own compression when the embedding count changes.
        self.residual = (
            LinearCompressionBlock(num_inputs, num_outputs, config.mixing)
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
