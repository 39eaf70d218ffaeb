"""What SASRec and HSTU share: item and position embeddings, scoring, user embeddings.

`forward(batch)` returns scores:
- a training batch (`targets`, `negatives`) gives `[..., 1 + N]`: the target's score, then
  the N shared negatives', at every position (`[B, L, 1 + N]` padded, `[T, 1 + N]` jagged);
- an evaluation batch (`candidates` `[B, C]`) gives `[B, C]`: each candidate scored
  against the final state of the history.

Scoring multiplies hidden states with rows of the (tied) item embedding table: that GEMM is
the one in these models that is not an `nn.Linear`, as in production retrieval heads.

A training forward looks the table up once, for the history, targets and negatives together
(`lookup`): a sparse table (`sparse_embeddings=True`) then gets one sparse gradient from the
backward. Three lookups gave three, summed by an `aten.add` inside the compiled backward,
which torch 2.11's inductor miscompiles: it runs ops on sparse tensors made in the graph as
fallbacks whose output it infers from dense stand-ins (an `assert_size_stride` failure on
the first backward; pytorch/pytorch#192092, still open, would fix it upstream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loka.zoo.layers import NormKind, item_table
from loka.zoo.models.features import require_positive

Similarity = Literal["dot", "cosine"]


@dataclass(frozen=True)
class SequentialConfig:
    num_items: int = 1000
    max_seq_len: int = 16
    embedding_dim: int = 32
    num_heads: int = 2
    num_layers: int = 2
    norm: NormKind = "layernorm"
    similarity: Similarity = "dot"
    temperature: float = 1.0  # scores are divided by it
    # A sparse item-table gradient, for the row-wise Adagrad of `loka.zoo.make_optimizer`.
    sparse_embeddings: bool = False

    def __post_init__(self) -> None:
        require_positive(
            self, "num_items", "max_seq_len", "embedding_dim", "num_heads", "num_layers"
        )
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"embedding_dim {self.embedding_dim} must be divisible by num_heads "
                f"{self.num_heads}"
            )
        if self.similarity not in ("dot", "cosine"):
            raise ValueError(f"similarity must be 'dot' or 'cosine', got {self.similarity!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")


def check_items(items: torch.Tensor, num_items: int) -> None:
    if items.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"item ids must be int32 or int64, got {items.dtype}")
    if torch.compiler.is_compiling():
        return
    in_range = ((items >= 0) & (items <= num_items)).all()
    torch._assert_async(in_range, f"item id outside [0, {num_items}] (0 is padding)")


class SequentialRecommender(nn.Module):
    """Base class: subclasses implement `encode(batch)` (hidden states, same layout as the
    batch's items) after embedding tokens with `embed(items, from_end)`."""

    def __init__(self, config: SequentialConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.item_embeddings = item_table(
            config.num_items + 1, dim, sparse=config.sparse_embeddings
        )
        # Positions count back from the most recent item, so any history length lines up.
        self.position_embeddings = nn.Embedding(config.max_seq_len, dim)
        with torch.no_grad():
            self.item_embeddings.weight.normal_(0.0, dim**-0.5)
            self.item_embeddings.weight[0].zero_()
            self.position_embeddings.weight.normal_(0.0, dim**-0.5)

    def encode(
        self, batch: dict[str, torch.Tensor], item_vectors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states of `batch["items"]`; `item_vectors`, their table rows (`[*items.shape,
        D]`) when already looked up (`lookup`), else `embed` looks them up."""
        raise NotImplementedError

    def lookup(self, *ids: torch.Tensor) -> list[torch.Tensor]:
        """The item-table rows `[*i.shape, D]` of each id tensor `i`, from one lookup of the
        concatenated ids: one (sparse) table gradient, not one per tensor (module docstring)."""
        flat = torch.cat([i.reshape(-1) for i in ids])
        check_items(flat, self.config.num_items)
        vectors = self.item_embeddings(flat).split([i.numel() for i in ids])
        return [v.view(*i.shape, -1) for v, i in zip(vectors, ids, strict=True)]

    def embed(
        self, items: torch.Tensor, from_end: torch.Tensor, vectors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Input tokens: item rows (`vectors`, or looked up here) scaled, plus positions."""
        if vectors is None:
            check_items(items, self.config.num_items)
            vectors = self.item_embeddings(items)
        scale = self.config.embedding_dim**0.5
        tokens = vectors * scale + self.position_embeddings(from_end)
        return tokens * (items != 0).unsqueeze(-1)

    def padded_positions(self, items: torch.Tensor) -> torch.Tensor:
        """Distance from the most recent item for a left-padded `[B, L]` batch."""
        if items.dim() != 2:
            raise ValueError(f"padded items must be [batch, length], got {tuple(items.shape)}")
        length = items.size(1)
        if length > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {length} exceeds max_seq_len {self.config.max_seq_len}"
            )
        return torch.arange(length - 1, -1, -1, device=items.device).expand_as(items)

    def item_vectors(self, items: torch.Tensor) -> torch.Tensor:
        return self._candidate_space(self.item_embeddings(items))

    def _candidate_space(self, vectors: torch.Tensor) -> torch.Tensor:
        return F.normalize(vectors, dim=-1) if self.config.similarity == "cosine" else vectors

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.similarity == "cosine":
            hidden = F.normalize(hidden, dim=-1)
        return hidden / self.config.temperature

    def final_states(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "offsets" in batch:
            return hidden[batch["offsets"][1:] - 1]
        return hidden[:, -1]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "candidates" in batch:
            hidden = self.encode(batch)
            check_items(batch["candidates"], self.config.num_items)
            users = self._queries(self.final_states(hidden, batch))
            candidates = self.item_vectors(batch["candidates"])
            return torch.einsum("bd,bcd->bc", users, candidates.to(users.dtype))
        if "targets" not in batch or "negatives" not in batch:
            raise ValueError(
                "a sequential batch needs 'candidates' (evaluation) or 'targets' and "
                f"'negatives' (training); got keys {sorted(batch)}"
            )
        tokens, positives, negatives = self.lookup(
            batch["items"], batch["targets"], batch["negatives"]
        )
        queries = self._queries(self.encode(batch, tokens))
        positives = self._candidate_space(positives).to(queries.dtype)
        negatives = self._candidate_space(negatives).to(queries.dtype)
        positive = (queries * positives).sum(-1, keepdim=True)
        return torch.cat([positive, queries @ negatives.T], dim=-1)

    def user_embedding(self, item_seq: torch.Tensor) -> torch.Tensor:
        """The final hidden state `[B, D]` of left-padded histories `[B, L]` (0 pads).

        Histories longer than `max_seq_len` keep their most recent items.
        """
        if item_seq.dim() != 2:
            raise ValueError(f"item_seq must be [batch, length], got {tuple(item_seq.shape)}")
        item_seq = item_seq[:, -self.config.max_seq_len :]
        nonempty = (item_seq != 0).any(1)
        if bool((nonempty & (item_seq[:, -1] == 0)).any()):
            raise ValueError("item_seq must be left-padded: its last column holds a pad (0)")
        return self.encode({"items": item_seq})[:, -1]


class PopularityModel(nn.Module):
    """The popularity baseline: scores each candidate by its training interaction count."""

    def __init__(self, counts: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("counts", counts.float())

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "candidates" not in batch:
            raise ValueError("the popularity baseline only scores evaluation batches")
        return self.counts[batch["candidates"]]
