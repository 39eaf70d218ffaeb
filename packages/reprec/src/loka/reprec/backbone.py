"""The LLM backbone: any Hugging Face causal LM from a local folder, or, since no pretrained
LLM can be downloaded here, a small Llama-style model pretrained on the training split's
histories written as text ("user history : item_3 item_17 ...") followed by yes/no
questions whose answers only the text itself gives (`PretrainConfig`).

Pretraining sees only each user's training part (all but the last two items), so the
validation and test targets never reach the backbone.
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loka.reprec.examples import pretraining_questions
from loka.reprec.prompts import PromptEncoder
from loka.reprec.train import optimizer_step
from loka.zoo.data.amazon import AmazonSequences, left_padded, split_prefix
from loka.zoo.data.seeding import stream_seed


@dataclass(frozen=True)
class BackboneConfig:
    """A small Llama: tied input/output embeddings, so most parameters are the vocabulary's."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 256
    # Weights' initial std. At Hugging Face's 0.02 the small model's attention starts flat
    # and its gradients vanish: pretraining never leaves the Yes/No prior (issue 19).
    initializer_range: float = 0.1

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}"
            )


@dataclass(frozen=True)
class PretrainConfig:
    """Causal language modelling on the training histories: each user's text, in a seeded
    order per epoch, one text a row (`pretraining_blocks`; padding neither read nor
    predicted), `batch_size` texts a step.

    Each text is a history followed by `questions` yes/no questions and their answers, "...
    . candidate : item_7 . is it in the history ? answer : Yes", every answer " Yes" or "
    No" with probability 1/2 and the " No" candidates drawn by popularity, so that the
    answer can only be read from the text, never guessed from a prior. With `next_item`,
    the history stops one item short of the user's training part and the first question is
    the prompt's own, "is it the next item ?", about that held-back item (or a sampled
    one); the others ask whether the candidate is in the history. Answer tokens weigh
    `answer_weight` times a history token in the loss, so that answering, not continuing
    histories, is what the small model spends its capacity on.

    The objective before issue 19 (`PretrainConfig.legacy()`: one membership question
    after the whole history, unweighted) let a small model learn the Yes/No ratio and
    answer without reading its prompt; no injector can condition such a backbone.
    """

    epochs: int = 4
    batch_size: int = 32  # texts per step
    block: int = 128  # the longest text, in tokens
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.05  # share of the steps with a linearly rising learning rate
    # After the warmup: "constant", or "cosine" decay to 0. Answering from the prompt comes
    # after a plateau at the prior; a decaying rate can end the run before it is left.
    schedule: str = "constant"
    questions: int = 4  # per text (0: the histories alone)
    next_item: bool = True
    answer_weight: float = 1000.0
    # "items": only item and answer tokens are predicted, so the vocabulary head (most of
    # a step's time at thousands of items) runs on a few positions per text; "all": every
    # token, the template's words too (`pretraining_loss`).
    predict: str = "items"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        if self.questions < 0:
            raise ValueError(f"questions must be >= 0, got {self.questions}")
        if self.next_item and self.questions < 1:
            raise ValueError("next_item asks the first question: questions must be >= 1")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if not self.answer_weight > 0:
            raise ValueError(f"answer_weight must be positive, got {self.answer_weight}")
        if self.predict not in ("all", "items"):
            raise ValueError(f"predict must be 'all' or 'items', got {self.predict!r}")

    @classmethod
    def legacy(cls, **overrides: Any) -> PretrainConfig:
        """The objective before issue 19: one membership question per text, unweighted,
        under a cosine schedule from 3e-3 (with `BackboneConfig(initializer_range=0.02)`)."""
        legacy = {"questions": 1, "next_item": False, "answer_weight": 1.0, "lr": 3e-3}
        legacy["predict"] = "all"
        return cls(**{**legacy, "schedule": "cosine", **overrides})


def build_backbone(config: BackboneConfig, tokenizer: Any, *, seed: int = 0) -> nn.Module:
    """A randomly initialized `LlamaForCausalLM` over `tokenizer`'s vocabulary."""
    import transformers

    llama = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(llama)


# "auto": "sasrec" for the small backbone built here, a loaded backbone's own embeddings.
ITEM_INITS = ("auto", "random", "sasrec")


def seed_item_embeddings(
    llm: nn.Module, prompts: PromptEncoder, item_vectors: torch.Tensor, *, seed: int = 0
) -> int:
    """Give the small backbone's item tokens a sequential encoder's item geometry: row i of
    `item_vectors` (`[num_items + 1, d]`, row 0 the padding item) becomes item i's token
    embedding through a fixed random orthonormal map to the LLM's width (dot products kept
    up to one scale; vectors wider than the LLM first keep their leading principal
    directions), rescaled to the embedding table's RMS. With titles a pretrained LLM
    knows its items; with ids only, this is the item knowledge the backbone can start from.
    Every other token keeps its row. Returns the number of rows set."""
    if prompts.item_ids.size(1) != 1:
        raise ValueError("seed_item_embeddings needs one token per item (the small backbone's "
                         "item tokenizer), got items of several tokens")  # fmt: skip
    if item_vectors.dim() != 2 or item_vectors.size(0) != prompts.num_items + 1:
        raise ValueError(
            f"item_vectors must be [num_items + 1 = {prompts.num_items + 1}, dim], "
            f"got {tuple(item_vectors.shape)}"
        )
    if not torch.isfinite(item_vectors).all():
        raise ValueError("item_vectors hold NaN or inf")
    table = llm.get_input_embeddings().weight
    width = table.size(1)
    vectors = item_vectors[1:].detach().double().cpu()
    if vectors.size(1) > width:  # wider than the backbone: its leading principal directions
        _, _, vh = torch.linalg.svd(vectors, full_matrices=False)
        vectors = vectors @ vh[:width].T
    generator = torch.Generator().manual_seed(seed)
    shape = (width, vectors.size(1))
    basis, _ = torch.linalg.qr(torch.randn(shape, generator=generator, dtype=torch.float64))
    vectors = vectors @ basis.T  # [num_items, width]
    with torch.no_grad():
        rms = table.double().pow(2).mean().sqrt().item()
        vectors *= rms / vectors.pow(2).mean().sqrt().clamp_min(1e-12).item()
        rows = prompts.item_ids[1:, 0].to(table.device)
        table[rows] = vectors.to(table.device, table.dtype)
    return int(rows.numel())


def training_texts(data: AmazonSequences) -> tuple[np.ndarray, np.ndarray]:
    """The users with training items and their training parts (all but the last two
    items), left-padded `[users, longest]`."""
    prefix = np.maximum(split_prefix(data, "train"), 0)
    users = np.flatnonzero(prefix > 0)
    return users, left_padded(data, users, prefix, int(prefix.max(initial=1)))


def pretraining_stream(
    prompts: PromptEncoder,
    data: AmazonSequences,
    *,
    questions: int = 1,
    next_item: bool = False,
    seed: int,
    epoch: int,
) -> torch.Tensor:
    """Every user's training history as text, in a seeded order, as one token stream; each
    text followed by `questions` questions and their answers (`PretrainConfig`). With
    `next_item`, a text shows its training part but the last item, and the first question
    asks whether the candidate is that item."""
    ids, mask = pretraining_texts(
        prompts, data, questions=questions, next_item=next_item, seed=seed, epoch=epoch
    )
    return ids[mask]  # row by row: each text starts with the head (and BOS)


def pretraining_blocks(
    prompts: PromptEncoder,
    data: AmazonSequences,
    *,
    block: int,
    questions: int = 1,
    next_item: bool = False,
    seed: int,
    epoch: int,
) -> torch.Tensor:
    """The texts of `pretraining_stream`, one a row, right-padded with `prompts.pad_id` to
    the longest (at most `block` tokens, or one history item whatever the block): a question
    reads its own history and no other text's (a history too long for a block keeps its
    latest items)."""
    fixed = len(prompts.prefix) + len(prompts.head)
    fixed += questions * (len(prompts.candidate_marker) + prompts.item_ids.size(1) + 1)
    fixed += questions * max(len(prompts.question), len(prompts.membership))
    max_items = max(1, (block - fixed) // prompts.item_ids.size(1))
    ids, mask = pretraining_texts(
        prompts,
        data,
        questions=questions,
        next_item=next_item,
        seed=seed,
        epoch=epoch,
        max_items=max_items,
    )
    width = int(mask.sum(1).max())
    return torch.where(mask, ids, prompts.pad_id)[:, :width]


def pretraining_texts(
    prompts: PromptEncoder,
    data: AmazonSequences,
    *,
    questions: int,
    next_item: bool,
    seed: int,
    epoch: int,
    max_items: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts of `pretraining_stream`, one a row (right-padded ids and mask), each
    history cut to its latest `max_items` items when given."""
    users, histories = training_texts(data)
    targets = None
    if next_item:
        if questions < 1:
            raise ValueError("next_item asks the first question: questions must be >= 1")
        keep = (histories != 0).sum(1) >= 2
        users, histories = users[keep], histories[keep]
        targets = histories[:, -1].copy()
        histories = np.concatenate([np.zeros_like(histories[:, :1]), histories[:, :-1]], 1)
    if max_items is not None:
        histories = histories[:, -max_items:]
    if len(users) == 0:
        raise ValueError("no training history to pretrain on: every user has < 3 items")
    rng = np.random.default_rng(stream_seed(seed, 11, epoch))
    order = rng.permutation(len(users))
    users, histories = users[order], histories[order]
    targets = None if targets is None else targets[order]
    candidates = answers = None
    if questions:
        drawn, yes = pretraining_questions(
            data, users, histories, rng, count=int(questions), targets=targets
        )
        candidates, answers = torch.from_numpy(drawn), torch.from_numpy(yes)
    return prompts.encode_histories(
        torch.from_numpy(histories), candidates, answers, next_first=next_item
    )


def pretraining_loss(
    llm: nn.Module,
    prompts: PromptEncoder,
    ids: torch.Tensor,
    *,
    answer_weight: float = 1.0,
    predict: str = "all",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted next-token loss of right-padded pretraining texts `ids` `[B, T]` (one
    text a row), and the loss of each answer token (detached, whole-vocabulary
    cross-entropy). Answer tokens weigh `answer_weight` times any other predicted token;
    padding is not predicted. `predict="items"` predicts only the tokens that are items or
    answers, so the vocabulary head runs on those positions alone (the template's words,
    most of a text, are not predicted); `"all"` predicts every token."""
    if predict not in ("all", "items"):
        raise ValueError(f"predict must be 'all' or 'items', got {predict!r}")
    answer_ids = torch.tensor([prompts.yes_id, prompts.no_id], device=ids.device)
    targets = ids[:, 1:]
    keep = targets != prompts.pad_id
    answer = torch.isin(targets, answer_ids)
    if predict == "items":
        items = prompts.item_ids[prompts.item_mask].to(ids.device)
        keep = keep & (answer | torch.isin(targets, items))
        hidden = llm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = llm.get_output_embeddings()(hidden[:, :-1][keep])
    else:
        logits = llm(input_ids=ids, use_cache=False).logits[:, :-1][keep]
    token = F.cross_entropy(logits.float(), targets[keep], reduction="none")
    answer = answer[keep]
    weight = 1.0 + (answer_weight - 1.0) * answer.float()
    return (token * weight).sum() / weight.sum(), token.detach()[answer]


def pretrain_backbone(
    llm: nn.Module,
    prompts: PromptEncoder,
    data: AmazonSequences,
    config: PretrainConfig | None = None,
    *,
    autocast_dtype: torch.dtype | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    answer_losses: list[float] | None = None,
) -> list[float]:
    """Train every parameter of `llm` to continue training histories written as text and
    answer their questions. Returns the (weighted) loss of every step; `answer_losses`, when
    given, receives each step's mean loss on the answer tokens alone (ln 2 = 0.693: no
    better than the prior). `on_step(step, total, loss)` follows progress."""
    config = config or PretrainConfig()
    device = next(llm.parameters()).device

    def blocks(epoch: int) -> torch.Tensor:
        return pretraining_blocks(
            prompts,
            data,
            block=config.block,
            questions=int(config.questions),
            next_item=config.next_item,
            seed=config.seed,
            epoch=epoch,
        )

    def loss(ids: torch.Tensor) -> torch.Tensor:
        value, answers = pretraining_loss(
            llm, prompts, ids, answer_weight=config.answer_weight, predict=config.predict
        )
        if answer_losses is not None and answers.numel():
            answer_losses.append(float(answers.mean()))
        return value

    first = blocks(0)
    per_epoch = max(1, len(first) // config.batch_size)
    total = per_epoch * config.epochs
    optimizer = torch.optim.AdamW(llm.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, int(config.warmup * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(
            (s + 1) / warmup,
            1.0 if config.schedule == "constant" else 0.5 * (1 + math.cos(math.pi * s / total)),
        ),
    )
    llm.train()
    losses: list[float] = []
    for epoch in range(config.epochs):
        # Later epochs hold about as many tokens (other questions): the same step count.
        chunk = (first if epoch == 0 else blocks(epoch)).to(device)
        for b in range(per_epoch):
            ids = chunk[b * config.batch_size : (b + 1) * config.batch_size]
            if len(ids) == 0:
                break
            # Right padding after a batch's longest text is neither read nor predicted.
            ids = ids[:, : int((ids != prompts.pad_id).sum(1).max())]
            value = optimizer_step(
                optimizer,
                functools.partial(loss, ids),
                device=device,
                autocast_dtype=autocast_dtype,
                where=f"pretraining step {len(losses)}",
            )
            schedule.step()
            losses.append(value)
            if on_step is not None:
                on_step(len(losses), total, value)
    llm.eval()
    return losses


def save_backbone(llm: nn.Module, tokenizer: Any, path: str | Path) -> Path:
    """Write the model and its tokenizer as a Hugging Face folder, atomically: a folder
    beside `path` is filled, then renamed onto it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        llm.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old."))
            path.rename(old / path.name)
            staging.rename(path)
            shutil.rmtree(old)
        else:
            staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def load_backbone(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[nn.Module, Any]:
    """A causal LM and its tokenizer from a local Hugging Face folder (ours or a real one)."""
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    llm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return llm.to(device).eval(), tokenizer
