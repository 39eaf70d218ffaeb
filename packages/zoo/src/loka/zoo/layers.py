"""Building blocks shared by the models.

Every GEMM here is an `nn.Linear` (or several in an `nn.ModuleList`) so that Probe can hook
each one and Mods can swap or group them. Norms that feed a linear are registered directly
before it, so module order shows the norm -> linear pairs that Mods may fuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from loka.zoo.rowwise_adagrad import FusedBagUpdate

NormKind = Literal["layernorm", "rmsnorm"]
Activation = Literal["relu", "gelu", "silu"]

# torch's own RMSNorm; re-exported so models and Mods name one class.
RMSNorm = nn.RMSNorm


def make_norm(kind: NormKind, width: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(width)
    if kind == "rmsnorm":
        return RMSNorm(width)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


def make_activation(kind: Activation) -> nn.Module:
    activations = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}
    if kind not in activations:
        raise ValueError(f"activation must be one of {sorted(activations)}, got {kind!r}")
    return activations[kind]()


def mlp(
    in_features: int,
    widths: Sequence[int],
    *,
    activation: Activation = "relu",
    activate_last: bool = True,
) -> nn.Sequential:
    """Linear -> activation, repeated; the last activation is optional (logit heads)."""
    layers: list[nn.Module] = []
    width_in = in_features
    for i, width in enumerate(widths):
        layers.append(nn.Linear(width_in, width))
        if activate_last or i < len(widths) - 1:
            layers.append(make_activation(activation))
        width_in = width
    return nn.Sequential(*layers)


def global_rows(sparse: torch.Tensor, row_offsets: torch.Tensor) -> torch.Tensor:
    """Map per-feature ids `[B, F, L]` (padding -1) to rows of one concatenated table.

    Row 0 of the concatenated table is the shared padding row, so feature f's id i lives
    at row `1 + row_offsets[f] + i`.
    """
    return torch.where(sparse >= 0, sparse + 1 + row_offsets.view(1, -1, 1), 0)


def check_sparse_ids(sparse: torch.Tensor, cardinalities: torch.Tensor) -> None:
    """Fail on an id outside its feature's table: it would silently read another table."""
    if sparse.dim() != 3 or sparse.size(1) != cardinalities.numel():
        raise ValueError(
            f"sparse ids must be [batch, {cardinalities.numel()} features, bag], "
            f"got shape {tuple(sparse.shape)}"
        )
    if sparse.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse ids must be int32 or int64, got {sparse.dtype}")
    if torch.compiler.is_compiling():
        return
    in_range = ((sparse >= -1) & (sparse < cardinalities.view(1, -1, 1))).all()
    # Asynchronous: no host sync on the GPU; raises at once on the CPU.
    torch._assert_async(in_range, "sparse id outside [-1, cardinality) of its feature")


PADDING_ROW = 0  # the concatenated table's shared padding row (global_rows maps -1 there)


def item_table(rows: int, dim: int, *, sparse: bool) -> nn.Embedding:
    """An embedding table whose row 0 is padding (zero, never updated): `padding_idx` when
    dense; when sparse, the `padding_row` the row-wise optimizer skips instead (a sparse
    backward with `padding_idx` syncs with the host: see `FeatureEmbeddings`)."""
    table = nn.Embedding(rows, dim, padding_idx=None if sparse else PADDING_ROW, sparse=sparse)
    table.padding_row = PADDING_ROW
    return table


class FeatureEmbeddings(nn.Module):
    """One pooled (sum) embedding bag per categorical feature, stored as one table.

    One concatenated table is what production table-batched embeddings do: a single lookup
    kernel for all features instead of one per feature. With `sparse=True` the table's
    gradient is sparse (the looked-up rows only), for `loka.zoo.optim.RowWiseAdagrad`.
    """

    def __init__(self, cardinalities: Sequence[int], dim: int, *, sparse: bool = False) -> None:
        super().__init__()
        sizes = torch.tensor(list(cardinalities), dtype=torch.int64)
        offsets = torch.cumsum(sizes, 0) - sizes
        self.register_buffer("row_offsets", offsets, persistent=False)
        self.register_buffer("cardinalities", sizes, persistent=False)
        self.num_features = len(cardinalities)
        self.dim = dim
        # Row 0 is padding: zero, never updated. Dense tables say so with `padding_idx`. A
        # sparse table does not: its backward's padding mask (a boolean select) synced with
        # the host, 2.3 ms of host time per step at Wukong xl, stalling the queue of a
        # compiled step; its gradient keeps the padding lookups and the row-wise optimizer
        # skips the row (`padding_row`, read by `loka.zoo.optim.sparse_tables`).
        self.bags = nn.EmbeddingBag(
            sum(cardinalities) + 1, dim, mode="sum", padding_idx=None if sparse else PADDING_ROW,
            sparse=sparse,
        )  # fmt: skip
        self.bags.padding_row = PADDING_ROW
        with torch.no_grad():
            # Small init keeps the dot interaction's products near unit scale.
            self.bags.weight.normal_(0.0, dim**-0.5)
            self.bags.weight[PADDING_ROW].zero_()
        self._fused: tuple[torch.Tensor, dict[str, Any]] | None = None

    def fuse_rowwise_adagrad(self, state: torch.Tensor, group: dict[str, Any]) -> None:
        """Update the table in the lookup's backward from now on (`FusedBagUpdate`):
        row-wise Adagrad with accumulator `state [rows]` and `group["lr"]`, `group["eps"]`
        (read at each forward). The table stops requiring grad and gets no `.grad`; a 0-dim
        parameter `update_trigger` (never given a gradient) makes autograd run the update.
        `loka.zoo.make_optimizer(model, OptimizerConfig(fused_tables=True))` calls this."""
        weight = self.bags.weight
        if not self.bags.sparse:
            raise ValueError("fused row-wise updates need sparse tables (sparse_embeddings=True)")
        if state.shape != weight.shape[:1] or state.dtype != torch.float32:
            raise ValueError("state must be float32, one value per table row")
        weight.requires_grad_(False)
        if not hasattr(self, "update_trigger"):
            self.update_trigger = nn.Parameter(torch.zeros((), device=weight.device))
        self._fused = (state, group)

    @property
    def fused(self) -> bool:
        """Whether the table is updated in the lookup's backward (`fuse_rowwise_adagrad`)."""
        return self._fused is not None

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        check_sparse_ids(sparse, self.cardinalities)
        batch, features, bag = sparse.shape
        rows = global_rows(sparse, self.row_offsets).reshape(batch * features, bag)
        if self._fused is not None:
            state, group = self._fused
            pooled = FusedBagUpdate.apply(
                self.update_trigger,
                self.bags.weight,
                rows,
                state,
                group["lr"],
                group["eps"],
                PADDING_ROW,
            )
            return pooled.view(batch, features, self.dim)
        return self.bags(rows).view(batch, features, self.dim)


class PerFeatureProjections(nn.Module):
    """One small Linear per feature: the many tiny GEMMs that Mods can group."""

    def __init__(self, num_features: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.projections = nn.ModuleList(
            nn.Linear(in_features, out_features) for _ in range(num_features)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.size(1) != len(self.projections):
            raise ValueError(f"expected {len(self.projections)} features, got {features.size(1)}")
        return torch.stack([proj(features[:, i]) for i, proj in enumerate(self.projections)], dim=1)


def dot_interaction(vectors: torch.Tensor) -> torch.Tensor:
    """Pairwise dot products of `[B, n, d]` vectors, strictly upper triangle: `[B, n(n-1)/2]`."""
    n = vectors.size(1)
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    rows, cols = torch.triu_indices(n, n, offset=1, device=vectors.device)
    return gram[:, rows, cols]
