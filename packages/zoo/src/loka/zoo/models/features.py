"""The input side shared by the CTR models: dense features and categorical tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loka.zoo.data.criteo import criteo_cardinalities
from loka.zoo.layers import Activation, FeatureEmbeddings, NormKind, mlp


def require_positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be a positive int, got {value!r}")


def require_widths(owner: object, name: str) -> None:
    widths = getattr(owner, name)
    if not isinstance(widths, tuple) or not widths:
        raise ValueError(f"{type(owner).__name__}.{name} must be a non-empty tuple")
    for width in widths:
        if not isinstance(width, int) or width <= 0:
            raise ValueError(f"{type(owner).__name__}.{name} has a bad width {width!r}")


@dataclass(frozen=True)
class CTRFeaturesConfig:
    """Criteo-like inputs: `num_dense` dense features and `num_sparse` categorical tables.

    Table sizes are Criteo's cardinalities (cycled past 26 features), capped at
    `max_table_rows` the way production hashes ids into a bounded table.
    """

    num_dense: int = 13
    num_sparse: int = 26
    max_table_rows: int | None = None
    embedding_dim: int = 16
    # The bottom MLP ends at embedding_dim so the dense vector joins the sparse ones.
    bottom_widths: tuple[int, ...] = (32,)
    # Sparse table gradients, for the row-wise Adagrad of `loka.zoo.make_optimizer`.
    sparse_embeddings: bool = False

    def __post_init__(self) -> None:
        require_positive(self, "num_dense", "num_sparse", "embedding_dim")
        if self.max_table_rows is not None:
            require_positive(self, "max_table_rows")
        require_widths(self, "bottom_widths")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return criteo_cardinalities(self.num_sparse, self.max_table_rows)

    @property
    def embedding_rows(self) -> int:
        return sum(self.cardinalities) + 1


@dataclass(frozen=True)
class CTRStackConfig(CTRFeaturesConfig):
    """What the layered CTR models (DHEN, Wukong) add: layers, a head, norm, activation."""

    num_layers: int = 2
    head_widths: tuple[int, ...] = (32,)
    norm: NormKind = "layernorm"
    activation: Activation = "relu"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "num_layers")
        require_widths(self, "head_widths")


class FeatureInputs(nn.Module):
    """The dense features through the bottom MLP, and the pooled categorical embeddings:
    `forward(batch) -> (dense_vector [B, d], pooled [B, F, d])`."""

    def __init__(self, config: CTRFeaturesConfig) -> None:
        super().__init__()
        self.num_dense = config.num_dense
        self.embeddings = FeatureEmbeddings(
            config.cardinalities, config.embedding_dim, sparse=config.sparse_embeddings
        )
        self.bottom = mlp(config.num_dense, (*config.bottom_widths, config.embedding_dim))

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        dense = batch["dense"]
        if dense.dim() != 2 or dense.size(1) != self.num_dense:
            raise ValueError(
                f"dense features must be [batch, {self.num_dense}], got {tuple(dense.shape)}"
            )
        if not dense.is_floating_point():
            raise ValueError(f"dense features must be floating point, got {dense.dtype}")
        dense_vector = self.bottom(dense)
        return dense_vector, self.embeddings(batch["sparse"]).to(dense_vector.dtype)
