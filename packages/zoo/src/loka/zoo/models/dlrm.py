"""DLRM (Naumov et al. 2019): bottom MLP, embedding bags, dot interaction, top MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loka.zoo.layers import dot_interaction, mlp
from loka.zoo.models.features import CTRFeaturesConfig, FeatureInputs, require_widths


@dataclass(frozen=True)
class DLRMConfig(CTRFeaturesConfig):
    top_widths: tuple[int, ...] = (64, 32)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_widths(self, "top_widths")

    @property
    def interaction_width(self) -> int:
        vectors = self.num_sparse + 1
        return vectors * (vectors - 1) // 2 + self.embedding_dim


class DLRM(nn.Module):
    """`forward(batch) -> logits [B]` from `batch["dense"]` and `batch["sparse"]`.

    The top MLP's input width (pairs + embedding_dim, 479 for Criteo's 26 tables at
    dim 128) is deliberately left unaligned, as in the reference model.
    """

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        self.inputs = FeatureInputs(config)
        self.top = mlp(config.interaction_width, (*config.top_widths, 1), activate_last=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dense_vector, pooled = self.inputs(batch)
        vectors = torch.cat([dense_vector.unsqueeze(1), pooled], dim=1)
        features = torch.cat([dense_vector, dot_interaction(vectors)], dim=1)
        return self.top(features).squeeze(-1)
