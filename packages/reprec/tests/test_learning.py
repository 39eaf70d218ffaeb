"""The injector learns what the user embedding carries: on a synthetic task where the answer
is a property of the user that no prompt token reveals, REPREC beats the zero-shot LM.

The backbone is a frozen random Llama whose answer reads its context (large initial
weights); a backbone whose answer ignores its context cannot be conditioned by soft tokens
at all, which `context_sensitivity` measures (what stalled REPREC on a weakly pretrained
backbone)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="REPREC needs transformers")

from loka.reprec.injector import InjectorConfig, UserEmbeddingInjector  # noqa: E402
from loka.reprec.model import PromptScorer, context_sensitivity  # noqa: E402
from loka.reprec.prompts import PromptEncoder  # noqa: E402
from loka.reprec.tokenizer import build_item_tokenizer  # noqa: E402
from loka.zoo.metrics import binary_auc  # noqa: E402

NUM_ITEMS, USERS, USER_DIM, LENGTH = 40, 64, 16, 5


class HashedUsers(nn.Module):
    """A stand-in for SASRec: a history's user is a hash of its items, and that user's
    embedding carries its class (+-2 in the first coordinate) among random features."""

    def __init__(self, classes: torch.Tensor, generator: torch.Generator) -> None:
        super().__init__()
        self.config = SimpleNamespace(embedding_dim=USER_DIM)
        table = torch.randn(USERS, USER_DIM, generator=generator)
        table[:, 0] = torch.where(classes, 2.0, -2.0)
        self.register_buffer("table", table)

    @staticmethod
    def user(history: torch.Tensor) -> torch.Tensor:
        return (history * torch.arange(1, history.size(1) + 1)).sum(1) % USERS

    def user_embedding(self, history: torch.Tensor) -> torch.Tensor:
        return self.table[self.user(history)]


def _batch(generator: torch.Generator, size: int, classes: torch.Tensor):
    history = torch.randint(1, NUM_ITEMS + 1, (size, LENGTH), generator=generator)
    candidates = torch.randint(1, NUM_ITEMS + 1, (size,), generator=generator)
    return history, candidates, classes[HashedUsers.user(history)]


def _auc(scorer: PromptScorer, batch) -> float:
    history, candidates, labels = batch
    with torch.no_grad():
        scores = scorer(history, candidates[:, None])[:, 0]
    return binary_auc(scores, labels.float())


@pytest.mark.parametrize("position", ["history", "bos"])
def test_injector_beats_zero_shot_when_the_user_embedding_holds_the_answer(
    position, tiny_llama
) -> None:
    generator = torch.Generator().manual_seed(1)
    classes = torch.rand(USERS, generator=generator) < 0.5
    tokenizer = build_item_tokenizer(NUM_ITEMS)
    prompts = PromptEncoder(tokenizer, NUM_ITEMS, history_items=LENGTH)
    llm = tiny_llama(len(tokenizer), initializer_range=0.3)
    scale = llm.get_input_embeddings().weight.pow(2).mean().sqrt().item()
    torch.manual_seed(0)
    injector = UserEmbeddingInjector(
        InjectorConfig(
            user_dim=USER_DIM, hidden_size=16, num_tokens=4, mlp_dim=32, output_scale=scale
        )
    )
    users = HashedUsers(classes, generator)
    reprec = PromptScorer(
        llm, prompts, injector=injector, user_encoder=users, soft_position=position
    )
    zero_shot = PromptScorer(llm, prompts)
    held_out = _batch(torch.Generator().manual_seed(99), 256, classes)
    prompts_only = SimpleNamespace(history=held_out[0], candidates=held_out[1][:, None])
    assert context_sensitivity(reprec, prompts_only) > 0.01  # the answer reads soft tokens

    optimizer = torch.optim.AdamW(injector.parameters(), lr=3e-3)
    reprec.train()
    losses = []
    for _ in range(120):
        loss = reprec.loss(*_batch(generator, 32, classes))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    reprec.eval()
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, losses
    zero_shot_auc, reprec_auc = _auc(zero_shot, held_out), _auc(reprec, held_out)
    assert abs(zero_shot_auc - 0.5) < 0.15, zero_shot_auc  # no prompt token holds the answer
    assert reprec_auc > 0.9, (reprec_auc, zero_shot_auc)


def test_context_sensitivity_flags_a_backbone_that_ignores_its_context(tiny_llama) -> None:
    # Default initialization (std 0.02): logits near zero whatever the input, as a small
    # backbone that only learned the Yes/No ratio; no injector can move its answer.
    tokenizer = build_item_tokenizer(NUM_ITEMS)
    llm = tiny_llama(len(tokenizer))
    generator = torch.Generator().manual_seed(1)
    injector = UserEmbeddingInjector(InjectorConfig(user_dim=USER_DIM, hidden_size=16))
    users = HashedUsers(torch.rand(USERS, generator=generator) < 0.5, generator)
    prompts = PromptEncoder(tokenizer, NUM_ITEMS, history_items=LENGTH)
    reprec = PromptScorer(llm, prompts, injector=injector, user_encoder=users)
    history, candidates, _ = _batch(generator, 32, users.table[:, 0] > 0)
    prompts_only = SimpleNamespace(history=history, candidates=candidates[:, None])
    assert context_sensitivity(reprec, prompts_only) < 0.01
