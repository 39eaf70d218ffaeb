"""A frozen causal LM that answers "is it the next item?" for (history, candidate)
prompts, optionally conditioned by REPREC soft tokens.

- With an injector and a user encoder (REPREC): the encoder's embedding of the history
  becomes m soft tokens prepended to the prompt's text (right after its leading special
  tokens, the BOS); the LLM and the encoder are frozen.
- Without (zero-shot, or LoRA when the LLM carries peft adapters): the plain prompt.

The loss is the cross-entropy of the answer token alone (" Yes" for the item that came
next, " No" for a sampled one) over the whole vocabulary; a candidate's score is
log p(" Yes").
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loka.reprec.injector import check_backbone, prepend_soft_tokens
from loka.reprec.prompts import PromptEncoder, position_ids

SoftPosition = Literal["history", "bos"]
SOFT_POSITIONS: tuple[str, ...] = ("history", "bos")


class PromptScorer(nn.Module):
    def __init__(
        self,
        llm: nn.Module,
        prompts: PromptEncoder,
        *,
        injector: nn.Module | None = None,
        user_encoder: nn.Module | None = None,
        soft_position: SoftPosition = "history",
    ) -> None:
        super().__init__()
        if (injector is None) != (user_encoder is None):
            raise ValueError("REPREC needs both an injector and a user encoder (or neither)")
        if soft_position not in SOFT_POSITIONS:
            raise ValueError(
                f"soft_position must be one of {SOFT_POSITIONS}, got {soft_position!r}"
            )
        self.soft_position = soft_position
        self.llm = llm
        self.prompts = prompts
        self.injector = injector
        self.user_encoder = user_encoder
        vocab = llm.get_input_embeddings().weight.shape[0]
        if max(prompts.yes_id, prompts.no_id, int(prompts.item_ids.max())) >= vocab:
            raise ValueError(
                f"the prompt's token ids exceed the backbone's vocabulary ({vocab}): the "
                "tokenizer and the backbone do not belong together"
            )
        if injector is not None:
            check_backbone(injector, llm)
            width = getattr(getattr(user_encoder, "config", None), "embedding_dim", None)
            if width is not None and width != injector.config.user_dim:
                raise ValueError(
                    f"the user encoder's embeddings have {width} dimensions but the injector "
                    f"takes {injector.config.user_dim}"
                )
            llm.requires_grad_(False)
            user_encoder.requires_grad_(False)
            user_encoder.eval()

    def train(self, mode: bool = True) -> PromptScorer:
        super().train(mode)
        if self.user_encoder is not None:
            self.user_encoder.eval()  # frozen: no dropout, whatever the mode
        return self

    @property
    def device(self) -> torch.device:
        return self.llm.get_input_embeddings().weight.device

    def soft_start(self, length: int) -> int:
        """Where the soft tokens go in prompts of `length` tokens. "history": right after
        the history's last item, before the candidate (every row's history ends there);
        "bos": right after the leading special tokens."""
        if self.soft_position == "bos":
            return self.prompts.prefix_length
        return length - self.prompts.suffix_length

    def soft_tokens(self, history: torch.Tensor) -> torch.Tensor | None:
        if self.injector is None:
            return None
        with torch.no_grad():
            users = self.user_encoder.user_embedding(history)
        return self.injector(users.float())

    def answer_log_probs(
        self,
        history: torch.Tensor,
        candidates: torch.Tensor,
        soft_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-probabilities `[B, vocab]` of the token after each prompt. `soft_tokens`
        `[B, m, D]` overrides the ones computed from `history` (REPREC only)."""
        ids, mask = self.prompts.encode(history, candidates)
        embeds = self.llm.get_input_embeddings()(ids)
        if self.injector is not None:
            if soft_tokens is None:
                soft_tokens = self.soft_tokens(history)
            start = self.soft_start(ids.size(1))
            text, text_mask, _ = prepend_soft_tokens(
                soft_tokens, embeds[:, start:], mask[:, start:]
            )
            embeds = torch.cat([embeds[:, :start], text], dim=1)
            mask = torch.cat([mask[:, :start], text_mask], dim=1)
        mask = mask.long()
        out = self.llm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=position_ids(mask),
            use_cache=False,
            logits_to_keep=1,
        )
        return F.log_softmax(out.logits[:, -1].float(), dim=-1)

    def loss(
        self, history: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy of the answer token: " Yes" where `labels`, else " No"."""
        if labels.shape != candidates.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} and candidates {tuple(candidates.shape)} differ"
            )
        log_probs = self.answer_log_probs(history, candidates)
        yes = torch.full_like(candidates, self.prompts.yes_id)
        answers = torch.where(labels.bool(), yes, self.prompts.no_id)
        return F.nll_loss(log_probs, answers)

    def forward(self, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Scores `[B, C]` (log p(" Yes")) of candidates `[B, C]` for histories `[B, L]`;
        REPREC computes each user's soft tokens once for all its candidates."""
        if candidates.dim() != 2 or candidates.size(0) != history.size(0):
            raise ValueError(
                f"candidates must be [{history.size(0)}, C], got {tuple(candidates.shape)}"
            )
        self.prompts.check_histories(history)
        count = candidates.size(1)
        soft = self.soft_tokens(history)
        if soft is not None:
            soft = soft.repeat_interleave(count, dim=0)
        log_probs = self.answer_log_probs(
            history.repeat_interleave(count, dim=0), candidates.reshape(-1), soft
        )
        return log_probs[:, self.prompts.yes_id].view(-1, count)


@torch.no_grad()
def context_sensitivity(scorer: PromptScorer, eval_set, *, rows: int = 32, seed: int = 0) -> float:
    """Mean |change of log p(" Yes")| when a REPREC scorer's soft tokens are replaced by
    random ones of the same size, on the first `rows` users' target prompts. Near 0, the
    frozen backbone's answer ignores the soft tokens and no injector can learn through it
    (what kept REPREC's injector from learning on a weakly pretrained backbone)."""
    history = eval_set.history[:rows].to(scorer.device)
    candidates = eval_set.candidates[:rows, 0].to(scorer.device)
    mode = scorer.training
    scorer.eval()
    try:
        soft = scorer.soft_tokens(history)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn(soft.shape, generator=generator).to(soft) * soft.std()
        base = scorer.answer_log_probs(history, candidates, soft)[:, scorer.prompts.yes_id]
        moved = scorer.answer_log_probs(history, candidates, noise)[:, scorer.prompts.yes_id]
    finally:
        scorer.train(mode)
    return float((moved - base).abs().mean())
