"""The REPREC user-embedding injector: a sequential encoder's user embedding becomes a few
soft tokens that condition a frozen LLM.

    u [B, user_dim] -> Linear -> GELU -> Dropout -> Linear -> reshape [B, m, D] -> LayerNorm

The soft tokens are prepended to the prompt's token embeddings (`inputs_embeds`), with the
attention mask on and the labels ignored (-100) at their positions. Only the injector
trains; the LLM and the encoder stay frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # the label value Hugging Face losses skip


@dataclass(frozen=True)
class InjectorConfig:
    """`user_dim`: the encoder's embedding width; `hidden_size`: the LLM's (D);
    `num_tokens`: soft tokens per user (m); `mlp_dim`: the MLP's inner width.

    `output_scale` initializes the LayerNorm's weight: set it to the RMS of the LLM's token
    embeddings so that soft tokens start at the scale the LLM was trained on.
    """

    user_dim: int
    hidden_size: int
    num_tokens: int = 6
    mlp_dim: int = 128
    dropout: float = 0.1
    output_scale: float = 1.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("user_dim", "hidden_size", "num_tokens", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.output_scale > 0.0:
            raise ValueError(f"output_scale must be positive, got {self.output_scale}")


class UserEmbeddingInjector(nn.Module):
    """Maps user embeddings `[B, user_dim]` to soft tokens `[B, num_tokens, hidden_size]`."""

    def __init__(self, config: InjectorConfig) -> None:
        super().__init__()
        self.config = config
        self.up = nn.Linear(config.user_dim, config.mlp_dim)
        self.down = nn.Linear(config.mlp_dim, config.num_tokens * config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.eps)
        with torch.no_grad():
            self.norm.weight.fill_(config.output_scale)

    def forward(self, user_embedding: torch.Tensor) -> torch.Tensor:
        config = self.config
        if user_embedding.dim() != 2 or user_embedding.size(1) != config.user_dim:
            raise ValueError(
                f"user embeddings must be [batch, {config.user_dim}], "
                f"got {tuple(user_embedding.shape)}"
            )
        if not user_embedding.is_floating_point():
            raise ValueError(f"user embeddings must be floating point, got {user_embedding.dtype}")
        hidden = F.dropout(F.gelu(self.up(user_embedding)), config.dropout, self.training)
        tokens = self.down(hidden).view(-1, config.num_tokens, config.hidden_size)
        return self.norm(tokens)


class SoftPrompt(NamedTuple):
    inputs_embeds: torch.Tensor  # [B, m + T, D]
    attention_mask: torch.Tensor  # [B, m + T], 1 on the soft tokens
    labels: torch.Tensor | None  # [B, m + T], IGNORE_INDEX on the soft tokens


def prepend_soft_tokens(
    soft_tokens: torch.Tensor,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> SoftPrompt:
    """Put `soft_tokens` `[B, m, D]` before the prompt's embeddings `[B, T, D]`; the mask
    attends to them and the labels (when given) ignore them."""
    if soft_tokens.dim() != 3 or inputs_embeds.dim() != 3:
        raise ValueError(
            f"soft tokens and prompt embeddings must be [batch, tokens, hidden], got "
            f"{tuple(soft_tokens.shape)} and {tuple(inputs_embeds.shape)}"
        )
    batch, num_soft, hidden = soft_tokens.shape
    if inputs_embeds.size(2) != hidden:
        raise ValueError(
            f"soft tokens have hidden size {hidden} but the LLM's token embeddings have "
            f"{inputs_embeds.size(2)}: build the injector with hidden_size={inputs_embeds.size(2)}"
        )
    if inputs_embeds.size(0) != batch:
        raise ValueError(
            f"{batch} rows of soft tokens for {inputs_embeds.size(0)} prompts: one per prompt"
        )
    length = inputs_embeds.size(1)
    if attention_mask is None:
        attention_mask = torch.ones(batch, length, dtype=torch.long, device=inputs_embeds.device)
    if attention_mask.shape != (batch, length):
        raise ValueError(
            f"attention_mask must be [{batch}, {length}], got {tuple(attention_mask.shape)}"
        )
    soft_mask = torch.ones(
        batch, num_soft, dtype=attention_mask.dtype, device=attention_mask.device
    )
    embeds = torch.cat([soft_tokens.to(inputs_embeds.dtype), inputs_embeds], dim=1)
    mask = torch.cat([soft_mask, attention_mask], dim=1)
    if labels is None:
        return SoftPrompt(embeds, mask, None)
    if labels.shape != (batch, length):
        raise ValueError(f"labels must be [{batch}, {length}], got {tuple(labels.shape)}")
    ignored = torch.full((batch, num_soft), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    return SoftPrompt(embeds, mask, torch.cat([ignored, labels], dim=1))


def check_backbone(injector: UserEmbeddingInjector, model: nn.Module) -> None:
    """Raise if `model`'s token embeddings (`get_input_embeddings()`, as Hugging Face models
    have) are not as wide as the injector's soft tokens."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if get_embeddings is None:
        raise TypeError(
            f"{type(model).__name__} has no get_input_embeddings(); the backbone must be a "
            "Hugging Face causal LM (or expose its token embedding)"
        )
    width = get_embeddings().weight.shape[-1]
    if width != injector.config.hidden_size:
        raise ValueError(
            f"the backbone's hidden size is {width} but the injector makes soft tokens of "
            f"{injector.config.hidden_size}: build the injector with hidden_size={width}"
        )


def parameter_share(trainable: nn.Module, frozen: nn.Module) -> float:
    """Parameters of `trainable` as a fraction of everything (`trainable` + `frozen`)."""
    own = sum(p.numel() for p in trainable.parameters())
    other = sum(p.numel() for p in frozen.parameters())
    return own / (own + other)


def injector_parameter_count(
    *, user_dim: int, hidden_size: int, num_tokens: int, mlp_dim: int
) -> int:
    """Parameters of an injector of that shape (two linears with biases, the LayerNorm)."""
    return (user_dim + 1) * mlp_dim + (mlp_dim + 1) * num_tokens * hidden_size + 2 * hidden_size


def injector_width_for(budget: int, *, user_dim: int, hidden_size: int, num_tokens: int) -> int:
    """The inner width whose injector has the parameter count closest to `budget` (at least
    1): how REPREC is held to LoRA's budget."""
    fixed = injector_parameter_count(
        user_dim=user_dim, hidden_size=hidden_size, num_tokens=num_tokens, mlp_dim=0
    )
    per_unit = user_dim + 1 + num_tokens * hidden_size
    return max(1, round((budget - fixed) / per_unit))
