"""InterFormer (after Zeng et al. 2024, "InterFormer: Towards Effective Heterogeneous
Interaction Learning for Click-Through Rate Prediction").

Two arms are interleaved layer by layer, with information flowing both ways:
- the interaction arm holds the non-sequence features `X [B, n, d]` (the dense features'
  bottom-MLP vector and one pooled embedding per categorical feature);
- the sequence arm holds the behaviour sequence `S [B, T, d]` (learned CLS tokens followed by
  the user's items, with learned positions counted from the most recent);
- the cross arm summarizes each arm for the other, so neither is collapsed early:
  `x_sum` = self-gated linear compression of X over the feature axis (`n_sum` vectors),
  `s_sum` = self-gated [CLS tokens, PMA tokens (learned queries attending over S), the most
  recent tokens] (`n_s` vectors).

Per layer: `X <- X + MLP(norm([X, dots([X, s_sum])]))` (behaviour-aware interactions, a
DHEN-style dot interaction plus MLP), and `S <- MHA(PFFN(S, x_sum))`, where the personalized
FFN `W2 (act(W1 norm(S)) * gate(x_sum))` is a per-example weight `W2 diag(gate) W1`, i.e. the
context-aware sequence transform the paper calls PFFN. The head reads the final summaries.

Every dense projection is an `nn.Linear`; every norm feeds the Linear registered right after
it. Departures from the paper, for a reference model: one behaviour sequence (no MaskNet over
several), learned positions instead of rotary ones, a dot + MLP interaction module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from loka.zoo.layers import (
    Activation,
    dot_interaction,
    item_table,
    make_activation,
    make_norm,
    mlp,
)
from loka.zoo.models.features import CTRStackConfig, FeatureInputs, require_positive
from loka.zoo.models.sequential import check_items

AttentionImpl = Literal["auto", "sdpa", "math"]


@dataclass(frozen=True)
class InterFormerConfig(CTRStackConfig):
    num_items: int = 1000  # behaviour-sequence vocabulary: ids 1..num_items, 0 pads
    max_seq_len: int = 16
    num_heads: int = 2
    interaction_hidden: int = 64
    sequence_hidden: int = 64  # PFFN hidden width
    num_summary: int = 2  # n_sum: non-sequence summary vectors
    num_cls: int = 1
    num_pma: int = 2
    num_recent: int = 2
    activation: Activation = "gelu"
    # "sdpa": F.scaled_dot_product_attention (on an H200, cuDNN's fused kernels); "math":
    # softmax(q k^T / sqrt(d) + mask) v in plain ops, which inductor fuses around two small
    # batched matmuls (under bf16 autocast the scores come out of their matmul in bf16 and
    # the softmax runs in float32, as Hugging Face's eager attention does; fused kernels
    # keep the scores in float32); "auto": "math" while torch.compile traces the model,
    # "sdpa" when it runs eagerly. The sequences here are short (CLS tokens + 16 items at
    # xl), where a fused kernel's tiles are mostly padding: compiled on an H200 at xl's
    # shapes, "math" runs the sequence block 1.12x and the pooling attention 1.45x faster
    # than SDPA (cuDNN), and the whole bf16 training step 1.088x
    # (`short_attention_20261204T185004Z`, `realized_20261204T185139Z`). Eagerly, plain
    # ops would run unfused, so "auto" keeps SDPA there.
    attention: AttentionImpl = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention not in get_args(AttentionImpl):
            raise ValueError(f"attention must be 'auto', 'sdpa' or 'math', got {self.attention!r}")
        require_positive(
            self, "num_items", "max_seq_len", "num_heads", "interaction_hidden",
            "sequence_hidden", "num_summary", "num_cls", "num_pma", "num_recent",
        )  # fmt: skip
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"embedding_dim {self.embedding_dim} must be divisible by num_heads "
                f"{self.num_heads}"
            )
        if self.num_recent > self.max_seq_len:
            raise ValueError(f"num_recent {self.num_recent} exceeds max_seq_len {self.max_seq_len}")

    @property
    def num_features(self) -> int:
        """n: the interaction arm's vectors (dense vector + one per categorical feature)."""
        return self.num_sparse + 1

    @property
    def sequence_summary(self) -> int:
        """n_s: the sequence summary's vectors."""
        return self.num_cls + self.num_pma + self.num_recent

    @property
    def interaction_width(self) -> int:
        vectors = self.num_features + self.sequence_summary
        return self.num_features * self.embedding_dim + vectors * (vectors - 1) // 2


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, T, d]` -> `[B, heads, T, d / heads]`."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, heads: int,
    how: str = "sdpa",
) -> torch.Tensor:  # fmt: skip
    """Multi-head attention of `q [B, Tq, d]` over the valid keys of `k, v [B, T, d]`
    (`how`: `InterFormerConfig.attention`). Every row has a valid key (the CLS tokens)."""
    if how == "auto":
        # Decided while tracing, so a compiled graph holds one branch and no guard on it.
        how = "math" if torch.compiler.is_compiling() else "sdpa"
    mask = valid.view(valid.size(0), 1, 1, -1)
    qh, kh, vh = _heads(q, heads), _heads(k, heads).to(q.dtype), _heads(v, heads).to(q.dtype)
    if how == "sdpa":
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    else:
        scores = (qh @ kh.transpose(-1, -2)) * qh.size(-1) ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vh.dtype) @ vh
    return out.transpose(1, 2).flatten(2)


class SelfGate(nn.Module):
    """`x * sigmoid(Linear(x))` over the flattened vectors `[B, m, d]`: the paper's gating,
    which selects what a summary passes on."""

    def __init__(self, vectors: int, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(vectors * dim, vectors * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.gate(x.flatten(1))).view_as(x)


class FeatureSummary(nn.Module):
    """`x_sum [B, n_sum, d]`: a Linear over the feature axis, then self-gating."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        self.compress = nn.Linear(config.num_features, config.num_summary, bias=False)
        self.gate = SelfGate(config.num_summary, config.embedding_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.compress(x.transpose(1, 2)).transpose(1, 2))


class PoolingAttention(nn.Module):
    """PMA: learned queries attend over the sequence's valid tokens."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.heads, self.attention = config.num_heads, config.attention
        self.norm = make_norm(config.norm, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.queries = nn.Parameter(torch.randn(config.num_pma, dim) * dim**-0.5)
        self.out = nn.Linear(dim, dim)

    def forward(self, seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        k, v = self.kv(self.norm(seq)).chunk(2, dim=-1)
        q = self.queries.to(k.dtype).expand(seq.size(0), -1, -1)
        return self.out(_attend(q, k, v, valid, self.heads, self.attention))


class SequenceSummary(nn.Module):
    """`s_sum [B, n_s, d]`: self-gated [CLS tokens, PMA tokens, most recent tokens]."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        self.num_cls, self.num_recent = config.num_cls, config.num_recent
        self.pma = PoolingAttention(config)
        self.gate = SelfGate(config.sequence_summary, config.embedding_dim)

    def forward(self, seq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        pooled = self.pma(seq, valid)
        cls, recent = seq[:, : self.num_cls], seq[:, seq.size(1) - self.num_recent :]
        return self.gate(torch.cat([cls.to(pooled.dtype), pooled, recent.to(pooled.dtype)], 1))


class CrossArm(nn.Module):
    """Summaries of both arms: `(x_sum, s_sum)`."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        self.features = FeatureSummary(config)
        self.sequence = SequenceSummary(config)

    def forward(
        self, x: torch.Tensor, seq: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features(x), self.sequence(seq, valid)


class InteractionBlock(nn.Module):
    """Behaviour-aware interactions: `X + MLP(norm([X, dots([X, s_sum])]))`."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        width = config.num_features * config.embedding_dim
        self.norm = make_norm(config.norm, config.interaction_width)
        self.fc1 = nn.Linear(config.interaction_width, config.interaction_hidden)
        self.activation = make_activation(config.activation)
        self.fc2 = nn.Linear(config.interaction_hidden, width)

    def forward(self, x: torch.Tensor, s_sum: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([x.to(s_sum.dtype), s_sum], dim=1)
        flat = torch.cat([x.flatten(1).to(s_sum.dtype), dot_interaction(vectors)], dim=1)
        return x + self.fc2(self.activation(self.fc1(self.norm(flat)))).view_as(x)


class SequenceBlock(nn.Module):
    """Context-aware sequence modeling: the personalized FFN, then multi-head attention."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        dim, hidden = config.embedding_dim, config.sequence_hidden
        self.heads, self.attention = config.num_heads, config.attention
        self.ffn_norm = make_norm(config.norm, dim)
        self.ffn_in = nn.Linear(dim, hidden)
        self.activation = make_activation(config.activation)
        self.personalize = nn.Linear(config.num_summary * dim, hidden)
        self.ffn_out = nn.Linear(hidden, dim)
        self.attention_norm = make_norm(config.norm, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, seq: torch.Tensor, x_sum: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(self.ffn_in(self.ffn_norm(seq)))
        # 2 * sigmoid: the gate starts near 1, so personalization rescales, never silences.
        gate = 2.0 * torch.sigmoid(self.personalize(x_sum.flatten(1)))
        seq = seq + self.ffn_out(hidden * gate.unsqueeze(1).to(hidden.dtype))
        q, k, v = self.qkv(self.attention_norm(seq)).chunk(3, dim=-1)
        seq = seq + self.out(_attend(q, k, v, valid, self.heads, self.attention))
        return seq * valid.unsqueeze(-1)  # padding stays zero


class InterFormerLayer(nn.Module):
    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        self.cross = CrossArm(config)
        self.interaction = InteractionBlock(config)
        self.sequence = SequenceBlock(config)

    def forward(
        self, x: torch.Tensor, seq: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x_sum, s_sum = self.cross(x, seq, valid)
        return self.interaction(x, s_sum), self.sequence(seq, x_sum, valid)


class InterFormer(nn.Module):
    """`forward(batch) -> logits [B]` from `batch["dense"]`, `batch["sparse"]` and
    `batch["sequence"]` (`[B, L]` item ids, left-padded with 0, most recent last)."""

    def __init__(self, config: InterFormerConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.inputs = FeatureInputs(config)
        self.items = item_table(config.num_items + 1, dim, sparse=config.sparse_embeddings)
        self.positions = nn.Embedding(config.max_seq_len, dim)
        self.cls = nn.Parameter(torch.randn(config.num_cls, dim) * dim**-0.5)
        with torch.no_grad():
            self.items.weight.normal_(0.0, dim**-0.5)
            self.items.weight[0].zero_()
            self.positions.weight.normal_(0.0, dim**-0.5)
        self.layers = nn.ModuleList(InterFormerLayer(config) for _ in range(config.num_layers))
        self.summary = CrossArm(config)
        summary = (config.num_summary + config.sequence_summary) * dim
        self.head = nn.Sequential(
            make_norm(config.norm, summary),
            *mlp(summary, (*config.head_widths, 1), activation=config.activation,
                 activate_last=False),
        )  # fmt: skip

    def embed_sequence(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(S [B, num_cls + L, d], valid [B, num_cls + L])` from left-padded items `[B, L]`."""
        if items.dim() != 2:
            raise ValueError(f"sequence must be [batch, length], got {tuple(items.shape)}")
        if items.size(1) > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {items.size(1)} exceeds max_seq_len {self.config.max_seq_len}"
            )
        check_items(items, self.config.num_items)
        from_end = torch.arange(items.size(1) - 1, -1, -1, device=items.device)
        present = items != 0
        tokens = (self.items(items) + self.positions(from_end)) * present.unsqueeze(-1)
        cls = self.cls.expand(items.size(0), -1, -1)
        valid = torch.cat([present.new_ones(items.size(0), self.config.num_cls), present], 1)
        return torch.cat([cls, tokens], dim=1), valid

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dense_vector, pooled = self.inputs(batch)
        x = torch.cat([dense_vector.unsqueeze(1), pooled], dim=1)
        seq, valid = self.embed_sequence(batch["sequence"])
        for layer in self.layers:
            x, seq = layer(x, seq, valid)
        x_sum, s_sum = self.summary(x, seq, valid)
        summary = torch.cat([x_sum.flatten(1).to(s_sum.dtype), s_sum.flatten(1)], dim=1)
        return self.head(summary).squeeze(-1)
