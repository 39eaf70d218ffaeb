"""The LLM backbone: any Hugging Face causal LM from a local folder, or, since no pretrained
LLM can be downloaded here, a small Llama-style model pretrained on the training split's
histories written as text ("user history : item_3 item_17 ...").

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
from torch import nn

from loka.reprec.examples import membership_questions
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
    order per epoch, concatenated and cut into blocks of `block` tokens (no padding).

    With `questions`, each text ends with a membership question, "... . candidate : item_7
    . is it in the history ? answer : Yes" (half the time an item of that history, else a
    popularity-sampled item the user's training part lacks): the small model learns to
    read a history and answer Yes/No, as a real LLM can, without ever seeing the
    next-item question that REPREC and LoRA are trained on.
    """

    epochs: int = 4
    batch_size: int = 32  # blocks per step
    block: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: float = 0.05  # share of the steps with a linearly rising learning rate
    questions: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")


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
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(llama)


def training_texts(data: AmazonSequences) -> tuple[np.ndarray, np.ndarray]:
    """The users with training items and their training parts (all but the last two
    items), left-padded `[users, longest]`."""
    prefix = np.maximum(split_prefix(data, "train"), 0)
    users = np.flatnonzero(prefix > 0)
    return users, left_padded(data, users, prefix, int(prefix.max(initial=1)))


def pretraining_stream(
    prompts: PromptEncoder, data: AmazonSequences, *, questions: bool, seed: int, epoch: int
) -> torch.Tensor:
    """Every user's training history as text, in a seeded order, as one token stream; with
    `questions`, each text ends with a membership question and its answer."""
    users, histories = training_texts(data)
    if len(users) == 0:
        raise ValueError("no training history to pretrain on: every user has < 3 items")
    rng = np.random.default_rng(stream_seed(seed, 11, epoch))
    order = rng.permutation(len(users))
    users, histories = users[order], histories[order]
    candidates = answers = None
    if questions:
        drawn, yes = membership_questions(data, users, histories, rng)
        candidates, answers = torch.from_numpy(drawn), torch.from_numpy(yes)
    ids, mask = prompts.encode_histories(torch.from_numpy(histories), candidates, answers)
    return ids[mask]  # row by row: each text starts with the head (and BOS)


def pretrain_backbone(
    llm: nn.Module,
    prompts: PromptEncoder,
    data: AmazonSequences,
    config: PretrainConfig | None = None,
    *,
    autocast_dtype: torch.dtype | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train every parameter of `llm` to continue training histories written as text.
    Returns the loss of every step; `on_step(step, total, loss)` follows progress."""
    config = config or PretrainConfig()
    device = next(llm.parameters()).device

    def blocks(epoch: int) -> torch.Tensor:
        stream = pretraining_stream(
            prompts, data, questions=config.questions, seed=config.seed, epoch=epoch
        )
        count = len(stream) // config.block
        if count == 0:
            raise ValueError(
                f"{len(stream)} tokens of training text do not fill a block of {config.block}"
            )
        return stream[: count * config.block].view(count, config.block)

    first = blocks(0)
    per_epoch = max(1, len(first) // config.batch_size)
    total = per_epoch * config.epochs
    optimizer = torch.optim.AdamW(llm.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, int(config.warmup * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / total))),
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
            value = optimizer_step(
                optimizer,
                functools.partial(_lm_loss, llm, ids),
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


def _lm_loss(llm: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return llm(input_ids=ids, labels=ids, use_cache=False).loss


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
