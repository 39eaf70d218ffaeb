"""DHEN-style stack (after Zhang et al. 2022, "DHEN: A Deep and Hierarchical Ensemble
Network"): many small per-feature projections, a dot interaction, then residual layers of
norm -> Linear -> activation -> Linear, and an MLP head.

The `large` preset mirrors the model measured in /work/shared/anchors: 32 tables of dim 128,
32 projections 128x128, 4 blocks 1024 -> 4096 -> 1024, batch 16384.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loka.zoo.layers import (
    Activation,
    PerFeatureProjections,
    dot_interaction,
    make_activation,
    make_norm,
    mlp,
)
from loka.zoo.models.features import CTRStackConfig, FeatureInputs, require_positive


@dataclass(frozen=True)
class DHENConfig(CTRStackConfig):
    width: int = 32
    hidden: int = 64
    activation: Activation = "gelu"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "width", "hidden")

    @property
    def interaction_width(self) -> int:
        vectors = self.num_sparse + 1
        return vectors * (vectors - 1) // 2 + self.embedding_dim


class DHENBlock(nn.Module):
    def __init__(self, config: DHENConfig) -> None:
        super().__init__()
        self.norm = make_norm(config.norm, config.width)
        self.fc1 = nn.Linear(config.width, config.hidden)
        self.activation = make_activation(config.activation)
        self.fc2 = nn.Linear(config.hidden, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.activation(self.fc1(self.norm(x))))


class DHEN(nn.Module):
    """`forward(batch) -> logits [B]` from `batch["dense"]` and `batch["sparse"]`."""

    def __init__(self, config: DHENConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.inputs = FeatureInputs(config)
        self.projections = PerFeatureProjections(config.num_sparse, dim, dim)
        self.input_projection = nn.Linear(config.interaction_width, config.width)
        self.blocks = nn.ModuleList(DHENBlock(config) for _ in range(config.num_layers))
        # The final norm opens the head so that it sits right before the Linear it feeds.
        self.head = nn.Sequential(
            make_norm(config.norm, config.width),
            *mlp(config.width, (*config.head_widths, 1), activate_last=False),
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dense_vector, pooled = self.inputs(batch)
        projected = self.projections(pooled)
        vectors = torch.cat([dense_vector.unsqueeze(1), projected.to(dense_vector.dtype)], dim=1)
        x = self.input_projection(torch.cat([dense_vector, dot_interaction(vectors)], dim=1))
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)
