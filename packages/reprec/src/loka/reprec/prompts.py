"""The prompt: a user's recent history and a candidate item, asking whether the user will
buy it next; the answer is one token, " Yes" or " No".

    user history : item_12 item_5 item_9 . candidate : item_33 . is it the next item ? answer :

The wording is the template's (`PromptTemplate`). The default phrases the question in the
format the small backbone is pretrained on (membership questions about a history, "is it in
the history ?"), so that a model that never saw the next-item question still answers it
with Yes or No; a real checkpoint can take any wording.

A prompt is a row of segments, each tokenized once by the backbone's own tokenizer and
joined as token ids: the head (with the tokenizer's special tokens, e.g. BOS), one segment
per history item, the candidate marker, the candidate item, the question. Assembling ids
from cached segments keeps scoring 100 candidates per user cheap, and works the same with
the word-level tokenizer of the small backbone (one token per item) and with a real
checkpoint's subword tokenizer (several tokens per item).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PromptTemplate:
    head: str = "user history :"
    item: str = "item_{}"
    candidate: str = ". candidate :"
    question: str = ". is it the next item ? answer :"
    membership: str = ". is it in the history ? answer :"  # pretraining only
    yes: str = " Yes"
    no: str = " No"

    def item_text(self, item: int) -> str:
        return self.item.format(int(item))

    def render(self, history: Sequence[int], candidate: int) -> str:
        """The prompt as text (without the answer), oldest history item first."""
        items = [self.item_text(i) for i in history]
        return " ".join(
            [self.head, *items, self.candidate, self.item_text(candidate), self.question]
        )

    def render_history(
        self, history: Sequence[int], candidate: int | None = None, answer: bool | None = None
    ) -> str:
        """A history as the small backbone is pretrained on it, with a membership question
        and its answer when `candidate` is given."""
        text = " ".join([self.head, *(self.item_text(i) for i in history)])
        if candidate is None:
            return text
        words = [text, self.candidate, self.item_text(candidate), self.membership]
        return " ".join(words) + (self.yes if answer else self.no)

    def words(self) -> list[str]:
        """Every whitespace-separated word of the template except the items."""
        parts = [self.head, self.candidate, self.question, self.membership, self.yes, self.no]
        text = " ".join(parts)
        return list(dict.fromkeys(text.split()))


def _ids(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def align(ids: torch.Tensor, mask: torch.Tensor, *, right: bool) -> tuple[torch.Tensor, ...]:
    """Move the real tokens (mask 1) of each row to its right end (`right=True`: left
    padding) or its left end, keeping their order."""
    key = mask.to(torch.int8) if right else (1 - mask.to(torch.int8))
    order = torch.sort(key, dim=1, stable=True).indices
    return ids.gather(1, order), mask.gather(1, order)


class PromptEncoder:
    """Token ids of prompts for a dataset of `num_items` items, from the backbone's
    tokenizer. `history_items` bounds the items a prompt shows (the most recent ones)."""

    def __init__(
        self,
        tokenizer: Any,
        num_items: int,
        *,
        template: PromptTemplate | None = None,
        history_items: int = 10,
    ) -> None:
        if num_items < 1:
            raise ValueError(f"num_items must be positive, got {num_items}")
        if history_items < 1:
            raise ValueError(f"history_items must be positive, got {history_items}")
        self.template = template or PromptTemplate()
        self.num_items = num_items
        self.history_items = history_items
        self.pad_id = _pad_id(tokenizer)
        self.prefix, self.head = self._split_special(tokenizer, self.template.head)
        self.candidate_marker = torch.tensor(_ids(tokenizer, " " + self.template.candidate))
        self.question = torch.tensor(_ids(tokenizer, " " + self.template.question))
        self.membership = torch.tensor(_ids(tokenizer, " " + self.template.membership))
        self.yes_id = self._single_token(tokenizer, self.template.yes)
        self.no_id = self._single_token(tokenizer, self.template.no)
        texts = [" " + self.template.item_text(i) for i in range(1, num_items + 1)]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        unk = getattr(tokenizer, "unk_token_id", None)
        for item, ids in enumerate(encoded, start=1):
            if not ids or (unk is not None and unk in ids):
                raise ValueError(
                    f"the tokenizer does not know item {item} ({texts[item - 1].strip()!r}): "
                    f"it was built for fewer than {num_items} items"
                )
        width = max(len(ids) for ids in encoded)
        # Row 0 is the padding item: no tokens. Items are left-padded inside their row.
        self.item_ids = torch.full((num_items + 1, width), self.pad_id, dtype=torch.long)
        self.item_mask = torch.zeros((num_items + 1, width), dtype=torch.bool)
        for item, ids in enumerate(encoded, start=1):
            self.item_ids[item, width - len(ids) :] = torch.tensor(ids)
            self.item_mask[item, width - len(ids) :] = True

    @staticmethod
    def _split_special(tokenizer: Any, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The special tokens the tokenizer puts before `text` (e.g. BOS), and `text`'s own
        tokens. Special tokens after it (an EOS some tokenizers append) are dropped: they
        would end the prompt before its question."""
        marked, plain = _ids(tokenizer, text, special=True), _ids(tokenizer, text)
        for start in range(len(marked) - len(plain) + 1):
            if marked[start : start + len(plain)] == plain:
                return torch.tensor(marked[:start], dtype=torch.long), torch.tensor(plain)
        return torch.zeros(0, dtype=torch.long), torch.tensor(marked)

    @property
    def prefix_length(self) -> int:
        """Leading special tokens of every prompt: soft tokens go right after them."""
        return len(self.prefix)

    @property
    def suffix_length(self) -> int:
        """Tokens after the history in every prompt (candidate marker, candidate item, question):
        the history ends at the same index in every row, since rows are left-padded."""
        return len(self.candidate_marker) + self.item_ids.size(1) + len(self.question)

    @staticmethod
    def _single_token(tokenizer: Any, text: str) -> int:
        ids = _ids(tokenizer, text)
        if len(ids) != 1:
            raise ValueError(f"the answer {text!r} must be one token; the tokenizer gives {ids}")
        return ids[0]

    def check_items(self, items: torch.Tensor, what: str, *, allow_pad: bool) -> None:
        if items.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what} must hold integer item ids, got {items.dtype}")
        low = 0 if allow_pad else 1
        bad = (items < low) | (items > self.num_items)
        if bool(bad.any()):
            unknown = sorted({int(i) for i in items[bad].unique()[:5].tolist()})
            raise ValueError(
                f"unknown item id(s) {unknown} in {what}: items are 1..{self.num_items}"
                + (" (0 pads)" if allow_pad else "")
            )

    def check_histories(self, history: torch.Tensor) -> None:
        if history.dim() != 2:
            raise ValueError(f"histories must be [batch, length], got {tuple(history.shape)}")
        self.check_items(history, "histories", allow_pad=True)
        empty = ~(history != 0).any(1)
        if bool(empty.any()):
            rows = torch.nonzero(empty).flatten()[:5].tolist()
            raise ValueError(
                f"empty history in row(s) {rows}: a user needs at least one past interaction"
            )

    def _items(self, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.item_ids.to(items.device)
        mask = self.item_mask.to(items.device)
        return table[items].flatten(1), mask[items].flatten(1)

    def encode(
        self, history: torch.Tensor, candidates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts for left-padded histories `[B, L]` and candidates `[B]`: token ids and
        attention mask `[B, T]`. Every row starts with the tokenizer's leading special
        tokens (`prefix_length` of them), then padding, then the text: every row ends with
        the question, and a soft prompt goes right after the special tokens."""
        self.check_histories(history)
        if candidates.shape != history.shape[:1]:
            raise ValueError(
                f"one candidate per history: got {tuple(candidates.shape)} for "
                f"{history.size(0)} histories"
            )
        self.check_items(candidates, "candidates", allow_pad=False)
        batch, device = history.size(0), history.device

        def fixed(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids = segment.to(device).expand(batch, -1)
            return ids, torch.ones_like(ids, dtype=torch.bool)

        parts = [
            fixed(self.head),
            self._items(history[:, -self.history_items :]),
            fixed(self.candidate_marker),
            self._items(candidates[:, None]),
            fixed(self.question),
        ]
        ids = torch.cat([p[0] for p in parts], dim=1)
        mask = torch.cat([p[1] for p in parts], dim=1)
        ids, mask = align(ids, mask, right=True)
        prefix_ids, prefix_mask = fixed(self.prefix)
        return torch.cat([prefix_ids, ids], dim=1), torch.cat([prefix_mask, mask], dim=1)

    def encode_histories(
        self,
        history: torch.Tensor,
        candidates: torch.Tensor | None = None,
        answers: torch.Tensor | None = None,
        *,
        next_first: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pretraining text: the head, then every item of the left-padded histories
        `[B, L]`; with `candidates` and `answers` (bool), `[B]` or `[B, K]`, K questions
        with their answers, one after the other. Each asks the membership question ("is it
        in the history ?"), except the first when `next_first`, which asks the prompt's own
        question ("is it the next item ?"). Right-padded token ids and mask."""
        self.check_histories(history)
        batch, device = history.size(0), history.device

        def fixed(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids = segment.to(device).expand(batch, -1)
            return ids, torch.ones_like(ids, dtype=torch.bool)

        parts = [fixed(torch.cat([self.prefix, self.head])), self._items(history)]
        if candidates is not None:
            if candidates.dim() == 1:
                candidates = candidates[:, None]
                answers = None if answers is None else answers[:, None]
            if answers is None or candidates.shape != answers.shape or len(candidates) != batch:
                raise ValueError("questions need one candidate and one answer each, per row")
            self.check_items(candidates, "candidates", allow_pad=False)
            answer = torch.where(answers.to(device).bool(), self.yes_id, self.no_id)
            one = torch.ones(batch, 1, dtype=torch.bool, device=device)
            for k in range(candidates.size(1)):
                parts += [
                    fixed(self.candidate_marker),
                    self._items(candidates[:, k : k + 1]),
                    fixed(self.question if next_first and k == 0 else self.membership),
                    (answer[:, k : k + 1], one),
                ]
        ids = torch.cat([p[0] for p in parts], dim=1)
        mask = torch.cat([p[1] for p in parts], dim=1)
        return align(ids, mask, right=False)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, so padding anywhere in a row is invisible."""
    return (mask.long().cumsum(1) - 1).clamp_min(0)
