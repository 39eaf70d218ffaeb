"""HSTU-style sequential transducer (Zhai et al. 2024, "Actions Speak Louder than Words").

Each layer: norm -> one fused U,V,Q,K Linear -> SiLU; pointwise attention
`SiLU(Q K^T * alpha + relative bias) / L` (no softmax) over causal, valid keys; then
norm(attention * U) -> output Linear, with a residual. The Linears run on the real tokens
only: a jagged batch of T tokens gives GEMMs with M = T, as production HSTU does; the
attention itself works on a padded `[B, heads, L, L]` grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loka.zoo.layers import make_norm
from loka.zoo.models.sequential import SequentialConfig, SequentialRecommender, Similarity


@dataclass(frozen=True)
class HSTUConfig(SequentialConfig):
    similarity: Similarity = "cosine"
    temperature: float = 0.05


@dataclass(frozen=True)
class TokenGrid:
    """Where each of the T tokens sits in the padded `[B, L]` attention grid."""

    batch: int
    length: int
    slots: torch.Tensor | None  # [T] flat grid index; None when tokens are the grid itself
    valid: torch.Tensor  # [B, L] bool

    def to_grid(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[T, C]` -> `[B, L, C]`, zeros where no token sits."""
        if self.slots is None:
            return tokens.view(self.batch, self.length, -1)
        grid = tokens.new_zeros(self.batch * self.length, tokens.size(-1))
        return grid.index_copy(0, self.slots, tokens).view(self.batch, self.length, -1)

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        flat = grid.reshape(self.batch * self.length, -1)
        return flat if self.slots is None else flat.index_select(0, self.slots)


class HSTULayer(nn.Module):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.input_norm = make_norm(config.norm, dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.output_norm = make_norm(config.norm, dim)
        self.out = nn.Linear(dim, dim)
        # One learned bias per relative distance i - j (0 .. max_seq_len - 1).
        self.relative_bias = nn.Parameter(torch.zeros(config.max_seq_len))

    def forward(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).chunk(4, dim=-1)
        heads, head_dim, length = self.num_heads, self.head_dim, grid.length

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return grid.to_grid(t).view(grid.batch, length, heads, head_dim).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        position = torch.arange(length, device=x.device)
        distance = position.view(-1, 1) - position.view(1, -1)
        allowed = (distance >= 0) & grid.valid.view(grid.batch, 1, 1, length)
        scores = q @ k.transpose(-1, -2) * head_dim**-0.5
        scores = scores + self.relative_bias[distance.clamp_min(0)].to(scores.dtype)
        weights = F.silu(scores) * allowed / length
        attended = (weights @ v).transpose(1, 2).reshape(grid.batch, length, heads * head_dim)
        attended = grid.from_grid(attended)
        return x + self.out(self.output_norm(attended * u))


class HSTU(SequentialRecommender):
    """Takes padded (`items` `[B, L]`, left-padded) or jagged (`items` `[T]`, `offsets`)
    batches; hidden states come back in the same layout."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))

    def encode(
        self, batch: dict[str, torch.Tensor], item_vectors: torch.Tensor | None = None
    ) -> torch.Tensor:
        items = batch["items"]
        if "offsets" in batch:
            tokens, from_end, grid = self._jagged(items, batch["offsets"])
        else:
            from_end = self.padded_positions(items)
            batch_size, length = items.shape
            grid = TokenGrid(batch_size, length, None, items != 0)
            tokens, from_end = items.reshape(-1), from_end.reshape(-1)
        vectors = None if item_vectors is None else item_vectors.reshape(*tokens.shape, -1)
        x = self.embed(tokens, from_end, vectors)
        for layer in self.layers:
            x = layer(x, grid)
        return x if "offsets" in batch else x.view(*items.shape, -1)

    def _jagged(
        self, items: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, TokenGrid]:
        if items.dim() != 1 or offsets.dim() != 1:
            raise ValueError("jagged batches need flat items [T] and offsets [B + 1]")
        length = self.config.max_seq_len
        batch = offsets.numel() - 1
        lengths = offsets.diff()
        if not torch.compiler.is_compiling():
            torch._assert_async(
                (lengths >= 0).all() & (lengths <= length).all() & (offsets[-1] == items.numel()),
                f"jagged offsets must be non-decreasing, end at len(items) and give sequences "
                f"of at most max_seq_len={length}",
            )
        row = torch.repeat_interleave(
            torch.arange(batch, device=items.device), lengths, output_size=items.numel()
        )
        position = torch.arange(items.numel(), device=items.device) - offsets[row]
        valid = torch.arange(length, device=items.device).view(1, -1) < lengths.view(-1, 1)
        grid = TokenGrid(batch, length, row * length + position, valid)
        return items, lengths[row] - 1 - position, grid
