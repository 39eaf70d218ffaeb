"""The small backbone's pretraining makes its answer read its prompt (issue 19).

On a tiny clustered dataset (each user buys from one of four item clusters), the pretraining
objective (several questions per text, answers balanced and only readable from the text,
weighted up) gives a backbone whose answer moves with the soft tokens and whose zero-shot
answer tells a history's items from others; the objective before issue 19 (one membership
question per text, unweighted, from the default initialization) gives one that learned the
Yes/No ratio alone, with the same number of steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="REPREC needs transformers")

from loka.reprec import BackboneConfig, PretrainConfig  # noqa: E402
from loka.reprec.backbone import build_backbone, pretrain_backbone  # noqa: E402
from loka.reprec.data import load_dataset  # noqa: E402
from loka.reprec.examples import eval_set  # noqa: E402
from loka.reprec.injector import InjectorConfig, UserEmbeddingInjector  # noqa: E402
from loka.reprec.model import PromptScorer, context_sensitivity  # noqa: E402
from loka.reprec.prompts import PromptEncoder  # noqa: E402
from loka.reprec.tokenizer import build_item_tokenizer  # noqa: E402
from loka.zoo.metrics import binary_auc  # noqa: E402

USER_DIM = 8


class RandomUsers(nn.Module):
    """A stand-in for SASRec: a fixed random embedding per history."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(embedding_dim=USER_DIM)
        self.register_buffer("table", torch.randn(97, USER_DIM))

    def user_embedding(self, history: torch.Tensor) -> torch.Tensor:
        return self.table[(history * torch.arange(1, history.size(1) + 1)).sum(1) % 97]


@pytest.fixture(scope="module")
def clustered(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(0)
    lines = []
    for user in range(200):
        cluster = 1 + 20 * (user % 4) + np.arange(20)
        length = (5, 12, 26)[user % 3]
        lines.append(" ".join(map(str, [user + 1, *rng.choice(cluster, length)])))
    path = tmp_path_factory.mktemp("clustered") / "Beauty.txt"
    path.write_text("\n".join(lines) + "\n")
    return load_dataset(str(path))


def _pretrained(data, backbone: BackboneConfig, config: PretrainConfig):
    tokenizer = build_item_tokenizer(data.num_items)
    prompts = PromptEncoder(tokenizer, data.num_items, history_items=50)
    llm = build_backbone(backbone, tokenizer)
    answers: list[float] = []
    pretrain_backbone(llm, prompts, data, config, answer_losses=answers)
    return llm.requires_grad_(False), prompts, float(np.mean(answers[-20:]))


def _readings(data, llm, prompts) -> tuple[float, float]:
    """The soft-token sensitivity (random injector) and the zero-shot AUC of the test item
    against uniform negatives."""
    chosen = eval_set(data, width=50, num_negatives=20, negative_sampling="uniform")
    torch.manual_seed(0)
    scale = llm.get_input_embeddings().weight.pow(2).mean().sqrt().item()
    injector = UserEmbeddingInjector(
        InjectorConfig(user_dim=USER_DIM, hidden_size=32, num_tokens=4, output_scale=scale)
    )
    reprec = PromptScorer(llm, prompts, injector=injector, user_encoder=RandomUsers())
    sensitivity = context_sensitivity(reprec, chosen, rows=64)
    with torch.no_grad():
        scores = PromptScorer(llm, prompts)(chosen.history, chosen.candidates)
    labels = torch.zeros_like(scores)
    labels[:, 0] = 1
    return sensitivity, binary_auc(scores.flatten(), labels.flatten())


BACKBONE = BackboneConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def test_pretraining_makes_the_answer_read_the_prompt(clustered) -> None:
    config = PretrainConfig(epochs=150, batch_size=32)  # 900 steps
    llm, prompts, answer_loss = _pretrained(clustered, BACKBONE, config)
    sensitivity, auc = _readings(clustered, llm, prompts)
    assert answer_loss < 0.5, answer_loss  # ln 2 = 0.693: the prior alone
    assert sensitivity > 0.05, sensitivity
    assert auc > 0.75, auc  # the held-out item's cluster is read from the history


def test_the_objective_before_issue_19_learns_the_prior_alone(clustered) -> None:
    old = BackboneConfig(**{**BACKBONE.__dict__, "initializer_range": 0.02})
    config = PretrainConfig.legacy(epochs=150, batch_size=32)
    llm, prompts, answer_loss = _pretrained(clustered, old, config)
    sensitivity, auc = _readings(clustered, llm, prompts)
    assert answer_loss > 0.65, answer_loss
    assert sensitivity < 0.05 and auc < 0.7, (sensitivity, auc)


def test_pretraining_texts_ask_balanced_questions_the_text_answers(clustered) -> None:
    from loka.reprec.backbone import pretraining_blocks, training_texts

    tokenizer = build_item_tokenizer(clustered.num_items)
    prompts = PromptEncoder(tokenizer, clustered.num_items)
    rows = pretraining_blocks(
        prompts, clustered, block=80, questions=3, next_item=True, seed=0, epoch=2
    )
    _, texts = training_texts(clustered)
    parts = {tuple(t[t > 0].tolist()) for t in texts}
    item_of = {int(prompts.item_ids[i, -1]): i for i in range(1, clustered.num_items + 1)}
    marker, yes, no = prompts.candidate_marker.tolist(), prompts.yes_id, prompts.no_id
    answers = []
    for row in rows.tolist():
        assert len(row) <= 80 and row[0] == tokenizer.bos_token_id
        text = [t for t in row if t != prompts.pad_id]
        starts = [i for i in range(len(text)) if text[i : i + len(marker)] == marker]
        history = [item_of[t] for t in text[prompts.prefix_length + len(prompts.head) : starts[0]]]
        assert len(starts) == 3 and text[-1] in (yes, no)
        # The shown history stops one item short of a training part, which the first
        # question asks about; the others ask about membership.
        full = [p for p in parts if p[:-1] == tuple(history)]
        assert full, history
        for k, start in enumerate(starts):
            candidate = item_of[text[start + len(prompts.candidate_marker)]]
            asked = start + len(prompts.candidate_marker) + 1
            question = prompts.question if k == 0 else prompts.membership
            assert text[asked : asked + len(question)] == question.tolist()
            answer = text[asked + len(question)]
            answers.append(answer == yes)
            if k == 0:
                assert (answer == yes) == any(p[-1] == candidate for p in full)
            else:
                assert (answer == yes) == (candidate in history)
    assert 0.4 < np.mean(answers) < 0.6
