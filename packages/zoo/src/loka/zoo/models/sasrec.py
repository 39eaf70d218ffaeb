"""SASRec (Kang & McAuley 2018): causal self-attention over the item history.

Pre-norm blocks, each LayerNorm registered right before the Linear it feeds; the attention
projections are one fused `qkv` Linear and an `out` Linear, the feed-forward two Linears.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loka.zoo.layers import make_norm
from loka.zoo.models.sequential import SequentialConfig, SequentialRecommender


@dataclass(frozen=True)
class SASRecConfig(SequentialConfig):
    ffn_multiplier: int = 1  # the original's feed-forward keeps the model width
    dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ffn_multiplier < 1:
            raise ValueError(f"ffn_multiplier must be positive, got {self.ffn_multiplier}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class SASRecBlock(nn.Module):
    def __init__(self, config: SASRecConfig) -> None:
        super().__init__()
        dim, hidden = config.embedding_dim, config.embedding_dim * config.ffn_multiplier
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.attention_norm = make_norm(config.norm, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn_norm = make_norm(config.norm, dim)
        self.ffn_in = nn.Linear(dim, hidden)
        self.ffn_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            self.qkv(self.attention_norm(x))
            .view(batch, length, 3, self.num_heads, dim // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        # Causal only, as in SASRec: left pads are zero vectors a query may attend to, and
        # every query keeps at least itself, so no row is empty.
        drop = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(
            self.out(attended.transpose(1, 2).reshape(batch, length, dim)), drop, self.training
        )
        x = x + F.dropout(self.ffn_out(F.relu(self.ffn_in(self.ffn_norm(x)))), drop, self.training)
        return x * valid


class SASRec(SequentialRecommender):
    """Padded batches only: `items` `[B, L]` left-padded."""

    def __init__(self, config: SASRecConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(SASRecBlock(config) for _ in range(config.num_layers))
        self.final_norm = make_norm(config.norm, config.embedding_dim)

    def encode(
        self, batch: dict[str, torch.Tensor], item_vectors: torch.Tensor | None = None
    ) -> torch.Tensor:
        if "offsets" in batch:
            raise ValueError("SASRec takes padded batches; build the data with layout='padded'")
        items = batch["items"]
        x = self.embed(items, self.padded_positions(items), item_vectors)
        x = F.dropout(x, self.config.dropout, self.training)
        valid = (items != 0).unsqueeze(-1).to(x.dtype)
        for block in self.blocks:
            x = block(x, valid)
        return self.final_norm(x)
