"""REPREC's model pieces on a tiny random Llama and a tiny SASRec: prompts, soft tokens in
the LLM's input, scores against a hand computation, gradients, saving and loading, LoRA,
pretraining, and clear errors for bad input."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="REPREC needs transformers")
pytest.importorskip("peft", reason="REPREC's LoRA baseline needs peft")

import loka.zoo as zoo  # noqa: E402
from loka.reprec import BackboneConfig, PretrainConfig, PromptScorer  # noqa: E402
from loka.reprec.backbone import (  # noqa: E402
    build_backbone,
    load_backbone,
    pretrain_backbone,
    pretraining_stream,
    save_backbone,
)
from loka.reprec.injector import InjectorConfig, UserEmbeddingInjector  # noqa: E402
from loka.reprec.lora import with_lora  # noqa: E402
from loka.reprec.prompts import PromptEncoder, PromptTemplate  # noqa: E402
from loka.reprec.tokenizer import build_item_tokenizer  # noqa: E402

NUM_ITEMS = 40


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("beauty")
    rng = np.random.default_rng(0)
    lines = [
        " ".join(map(str, [u + 1, *rng.integers(1, NUM_ITEMS + 1, int(rng.integers(4, 30)))]))
        for u in range(40)
    ]
    lines[0] = f"1 {' '.join(str(i) for i in range(1, NUM_ITEMS + 1))}"  # every item appears
    (folder / "Beauty.txt").write_text("\n".join(lines) + "\n")
    setup = zoo.create("sasrec", "tiny", dataset="beauty", data_dir=str(folder), batch_size=8)
    tokenizer = build_item_tokenizer(NUM_ITEMS)
    llm = build_backbone(
        BackboneConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32), tokenizer
    ).eval()
    prompts = PromptEncoder(tokenizer, NUM_ITEMS, history_items=5)
    return SimpleNamespace(
        folder=folder,
        data=setup.data.data,
        sasrec=setup.model.eval(),
        tokenizer=tokenizer,
        llm=llm,
        prompts=prompts,
    )


def _injector(user_dim: int = 32, hidden: int = 16) -> UserEmbeddingInjector:
    torch.manual_seed(0)
    return UserEmbeddingInjector(
        InjectorConfig(user_dim=user_dim, hidden_size=hidden, num_tokens=3, mlp_dim=8)
    ).eval()


def _reprec(parts: SimpleNamespace, position: str = "history") -> PromptScorer:
    return PromptScorer(
        parts.llm,
        parts.prompts,
        injector=_injector(),
        user_encoder=parts.sasrec,
        soft_position=position,  # type: ignore[arg-type]
    )


HISTORY = torch.tensor([[0, 0, 0, 3, 7], [1, 2, 3, 4, 5], [0, 9, 9, 12, 40]])
CANDIDATES = torch.tensor([11, 2, 40])


def test_prompt_ids_are_the_tokenized_text(parts: SimpleNamespace) -> None:
    ids, mask = parts.prompts.encode(HISTORY, CANDIDATES)
    assert ids.shape == mask.shape and mask[:, -1].all()  # left-padded: every row ends real
    template = PromptTemplate()
    for row in range(len(HISTORY)):
        history = [int(i) for i in HISTORY[row] if i != 0]
        text = template.render(history, int(CANDIDATES[row]))
        expected = parts.tokenizer(text)["input_ids"]
        assert ids[row][mask[row]].tolist() == expected
        assert expected[0] == parts.tokenizer.bos_token_id
    assert parts.tokenizer.decode([parts.prompts.yes_id]) == "Yes"
    # Only the most recent `history_items` items are shown.
    long = torch.arange(1, 11).view(1, 10)
    ids, mask = parts.prompts.encode(long, torch.tensor([1]))
    shown = parts.tokenizer.decode(ids[0][mask[0]])
    assert "item_6 item_7 item_8 item_9 item_10 ." in shown and "item_5 " not in shown


def test_soft_tokens_follow_the_bos_in_the_llm_input(parts: SimpleNamespace) -> None:
    scorer = _reprec(parts, "bos")
    seen = {}

    def capture(module, args, kwargs):
        seen.update(kwargs)

    handle = parts.llm.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        scorer.answer_log_probs(HISTORY, CANDIDATES)
    finally:
        handle.remove()
    ids, mask = parts.prompts.encode(HISTORY, CANDIDATES)
    assert parts.prompts.prefix_length == 1
    assert ids[:, 0].eq(parts.tokenizer.bos_token_id).all() and mask[:, 0].all()
    embeds, attention = seen["inputs_embeds"], seen["attention_mask"]
    assert embeds.shape == (3, 3 + ids.size(1), 16)
    # [BOS] [3 soft tokens] [the prompt, left-padded]: the mask is on for the soft tokens.
    assert attention[:, :4].eq(1).all() and attention[:, 4:].equal(mask[:, 1:].long())
    with torch.no_grad():
        soft = scorer.injector(parts.sasrec.user_embedding(HISTORY))
        tokens = parts.llm.get_input_embeddings()(ids)
        torch.testing.assert_close(embeds[:, 1:4], soft)
        torch.testing.assert_close(embeds[:, :1], tokens[:, :1])
        torch.testing.assert_close(embeds[:, 4:], tokens[:, 1:])
    # Positions count real tokens only: BOS 0, the soft tokens 1..3, the prompt follows.
    positions = seen["position_ids"]
    assert positions[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    assert positions[:, -1].tolist() == (2 + mask.sum(1)).tolist()


@pytest.mark.parametrize("position", [None, "bos", "history"])
def test_scores_are_log_p_yes_computed_by_hand(parts: SimpleNamespace, position) -> None:
    with_injector = position is not None
    scorer = _reprec(parts, position) if with_injector else PromptScorer(parts.llm, parts.prompts)
    candidates = torch.tensor([[11, 2], [2, 30], [40, 1]])
    with torch.no_grad():
        scores = scorer(HISTORY, candidates)
        assert scores.shape == (3, 2)
        for row in range(3):
            history = [int(i) for i in HISTORY[row] if i != 0]
            for col in range(2):
                text = PromptTemplate().render(history, int(candidates[row, col]))
                ids = torch.tensor([parts.tokenizer(text)["input_ids"]])
                embeds = parts.llm.get_input_embeddings()(ids)
                if with_injector:  # after the BOS, or after the history's last item
                    soft = scorer.injector(parts.sasrec.user_embedding(HISTORY[row : row + 1]))
                    # "... item_7 [soft] . candidate : item_11 . is it the next item ? answer :"
                    at = 1 if position == "bos" else ids.size(1) - parts.prompts.suffix_length
                    if position == "history":
                        assert ids[0, at - 1] == parts.prompts.item_ids[history[-1], -1]
                    embeds = torch.cat([embeds[:, :at], soft, embeds[:, at:]], dim=1)
                logits = parts.llm(inputs_embeds=embeds).logits[0, -1]  # no padding at all
                expected = F.log_softmax(logits, -1)[parts.prompts.yes_id]
                torch.testing.assert_close(scores[row, col], expected, atol=1e-5, rtol=1e-5)


def test_loss_is_the_answer_tokens_cross_entropy(parts: SimpleNamespace) -> None:
    scorer = _reprec(parts)
    labels = torch.tensor([True, False, True])
    with torch.no_grad():
        log_probs = scorer.answer_log_probs(HISTORY, CANDIDATES)
        answers = [parts.prompts.yes_id, parts.prompts.no_id, parts.prompts.yes_id]
        expected = -log_probs[torch.arange(3), answers].mean()
        torch.testing.assert_close(scorer.loss(HISTORY, CANDIDATES, labels), expected)


def test_only_the_injector_receives_gradients(parts: SimpleNamespace) -> None:
    scorer = _reprec(parts).train()
    scorer.loss(HISTORY, CANDIDATES, torch.tensor([True, False, False])).backward()
    assert all(p.grad is None and not p.requires_grad for p in parts.llm.parameters())
    assert all(p.grad is None and not p.requires_grad for p in parts.sasrec.parameters())
    grads = [p.grad for p in scorer.injector.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    trainable = sum(p.numel() for p in scorer.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in scorer.injector.parameters())
    assert not parts.sasrec.training  # the frozen encoder stays in eval mode


def test_the_injector_learns_a_fixed_batch(parts: SimpleNamespace, tiny_llama) -> None:
    # A backbone with large random weights (a default-initialized one barely reacts to any
    # input: its logits are all close to zero), frozen; only the injector trains.
    llm = tiny_llama(len(parts.tokenizer), initializer_range=0.3)
    injector = _injector()
    scorer = PromptScorer(llm, parts.prompts, injector=injector, user_encoder=parts.sasrec).train()
    optimizer = torch.optim.AdamW(injector.parameters(), lr=5e-2)
    labels = torch.tensor([True, False, True])
    losses = []
    for _ in range(25):
        loss = scorer.loss(HISTORY, CANDIDATES, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses


def test_bad_input_gets_a_clear_error(parts: SimpleNamespace) -> None:
    scorer = _reprec(parts)
    with pytest.raises(ValueError, match=r"empty history in row\(s\) \[1\]"):
        scorer(torch.tensor([[0, 3], [0, 0]]), torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match=r"unknown item id\(s\) \[41\] in histories"):
        scorer(torch.tensor([[3, 41]]), torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"unknown item id\(s\) \[0\] in candidates"):
        scorer(torch.tensor([[3, 4]]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match=r"backbone's hidden size is 16 .* soft tokens of 24"):
        PromptScorer(
            parts.llm, parts.prompts, injector=_injector(hidden=24), user_encoder=parts.sasrec
        )
    with pytest.raises(ValueError, match=r"user encoder's embeddings have 32 .* takes 8"):
        PromptScorer(
            parts.llm, parts.prompts, injector=_injector(user_dim=8), user_encoder=parts.sasrec
        )
    with pytest.raises(ValueError, match="does not know item 41"):
        PromptEncoder(parts.tokenizer, NUM_ITEMS + 1)
    with pytest.raises(ValueError, match="must be one token"):
        PromptEncoder(parts.tokenizer, NUM_ITEMS, template=PromptTemplate(yes=" Yes please"))
    small = build_backbone(BackboneConfig(hidden_size=8, num_layers=1, num_heads=1,
                                          intermediate_size=8), build_item_tokenizer(5))  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary"):
        PromptScorer(small, parts.prompts)


def test_padding_does_not_change_scores(parts: SimpleNamespace) -> None:
    scorer = _reprec(parts)
    with torch.no_grad():
        together = scorer(HISTORY, CANDIDATES[:, None])
        alone = torch.cat(
            [scorer(HISTORY[r : r + 1], CANDIDATES[r : r + 1, None]) for r in range(3)]
        )
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_backbone_round_trip_is_atomic(parts: SimpleNamespace, tmp_path: Path, monkeypatch) -> None:
    path = save_backbone(parts.llm, parts.tokenizer, tmp_path / "backbone")
    llm, tokenizer = load_backbone(path)
    prompts = PromptEncoder(tokenizer, NUM_ITEMS, history_items=5)
    with torch.no_grad():
        before = PromptScorer(parts.llm, parts.prompts)(HISTORY, CANDIDATES[:, None])
        after = PromptScorer(llm, prompts)(HISTORY, CANDIDATES[:, None])
    torch.testing.assert_close(before, after)
    # A failed save leaves the previous folder as it was and no staging folder behind.
    files = sorted(p.name for p in path.iterdir())

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(parts.tokenizer), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        save_backbone(parts.llm, parts.tokenizer, path)
    assert sorted(p.name for p in path.iterdir()) == files
    assert [p.name for p in tmp_path.iterdir()] == ["backbone"]
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_backbone(tmp_path)


def test_lora_copy_trains_q_and_v_adapters_only(parts: SimpleNamespace) -> None:
    adapted = with_lora(parts.llm, rank=8)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    targets = {part for n in trainable for part in n.split(".") if part.endswith("_proj")}
    assert targets == {"q_proj", "v_proj"}
    assert all(
        p.shape[0] == 8 or p.shape[1] == 8 for n, p in adapted.named_parameters() if "lora_" in n
    )
    assert not any("lora_" in n for n, _ in parts.llm.named_parameters())  # original untouched
    scorer = PromptScorer(adapted, parts.prompts).train()
    scorer.loss(HISTORY, CANDIDATES, torch.tensor([True, False, True])).backward()
    assert all(p.grad is not None for p in adapted.parameters() if p.requires_grad)


def test_pretraining_text_is_the_training_histories_with_membership_questions(
    parts: SimpleNamespace,
) -> None:
    template, prompts, tokenizer = PromptTemplate(), parts.prompts, parts.tokenizer
    history = torch.tensor([[0, 0, 4, 9], [1, 2, 3, 5]])
    candidates, answers = torch.tensor([9, 7]), torch.tensor([True, False])
    ids, mask = prompts.encode_histories(history, candidates, answers)
    assert mask[:, 0].all()  # right-padded
    assert (
        ids[0][mask[0]].tolist() == tokenizer(template.render_history([4, 9], 9, True))["input_ids"]
    )
    assert (
        ids[1][mask[1]].tolist()
        == tokenizer(template.render_history([1, 2, 3, 5], 7, False))["input_ids"]
    )

    stream = pretraining_stream(prompts, parts.data, questions=True, seed=0, epoch=1)
    bos, marker = tokenizer.bos_token_id, int(prompts.candidate_marker[0])
    starts = [*torch.nonzero(stream == bos).flatten().tolist(), len(stream)]
    texts = [stream[a:b].tolist() for a, b in itertools.pairwise(starts)]
    assert len(texts) == parts.data.num_users
    training_parts = {
        tuple(parts.data.sequence(u)[: len(parts.data.sequence(u)) - 2].tolist())
        for u in range(parts.data.num_users)
    }
    item_of = {int(prompts.item_ids[i, -1]): i for i in range(1, NUM_ITEMS + 1)}
    for text in texts:
        cut = text.index(marker)
        items = tuple(item_of[t] for t in text[prompts.prefix_length + len(prompts.head) : cut])
        assert items in training_parts
        candidate = item_of[text[cut + len(prompts.candidate_marker)]]
        assert text[-1] == (prompts.yes_id if candidate in items else prompts.no_id)
    plain = pretraining_stream(prompts, parts.data, questions=False, seed=0, epoch=1)
    assert marker not in plain.tolist() and prompts.yes_id not in plain.tolist()


def test_pretraining_lowers_the_language_model_loss(parts: SimpleNamespace) -> None:
    tokenizer = build_item_tokenizer(NUM_ITEMS)
    llm = build_backbone(
        BackboneConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tokenizer
    )
    prompts = PromptEncoder(tokenizer, NUM_ITEMS)
    config = PretrainConfig(epochs=6, batch_size=4, block=32, lr=1e-2)
    losses = pretrain_backbone(llm, prompts, parts.data, config)
    assert len(losses) > 10 and not llm.training
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses


def test_pretraining_loss_predicts_items_and_answers_only_when_asked(
    parts: SimpleNamespace,
) -> None:
    from loka.reprec.backbone import pretraining_blocks, pretraining_loss

    prompts, llm = parts.prompts, parts.llm
    ids = pretraining_blocks(prompts, parts.data, block=48, questions=2, seed=0, epoch=0)[:6]
    with torch.no_grad():
        logits = llm(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    answer = (targets == prompts.yes_id) | (targets == prompts.no_id)
    item = torch.isin(targets, prompts.item_ids[1:].flatten()) & (targets != prompts.pad_id)
    for predict, kept in (("all", targets != prompts.pad_id), ("items", answer | item)):
        weight = kept * (1.0 + 9.0 * answer)
        with torch.no_grad():
            value, answers = pretraining_loss(
                llm, prompts, ids, answer_weight=10.0, predict=predict
            )
            # Padding after the longest text changes nothing.
            padded = torch.cat([ids, torch.full_like(ids[:, :5], prompts.pad_id)], 1)
            again, _ = pretraining_loss(llm, prompts, padded, answer_weight=10.0, predict=predict)
        expected = (token * weight).sum() / weight.sum()
        assert torch.allclose(value, expected, atol=1e-5) and torch.allclose(
            again, expected, atol=1e-5
        )
        assert torch.allclose(answers, token[answer], atol=1e-5)
    assert bool((~(answer | item) & (targets != prompts.pad_id)).any())  # template words exist
    with pytest.raises(ValueError, match="predict"):
        PretrainConfig(predict="words")
