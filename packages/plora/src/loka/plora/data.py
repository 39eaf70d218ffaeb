"""Text data for the runner: fixed-length token blocks and one sample stream per job."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from loka.plora.config import LoraJobConfig


class TokenBlocks:
    """A corpus cut into `[n, seq_len + 1]` blocks of token ids (input and shifted label).

    Documents are tokenized, joined with the tokenizer's EOS token (when it has one) and
    cut into consecutive blocks; the tail shorter than a block is dropped.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dim() != 2 or blocks.shape[1] < 2 or blocks.dtype != torch.long:
            raise ValueError(
                f"blocks must be a [n, seq_len + 1] int64 tensor, got {tuple(blocks.shape)} "
                f"{blocks.dtype}"
            )
        if blocks.shape[0] == 0:
            raise ValueError(
                "the corpus gives no complete block; use more text or a shorter seq_len"
            )
        self.blocks = blocks

    @property
    def seq_len(self) -> int:
        return self.blocks.shape[1] - 1

    def __len__(self) -> int:
        return self.blocks.shape[0]

    @classmethod
    def from_token_ids(cls, ids: Iterable[int], seq_len: int) -> TokenBlocks:
        flat = torch.as_tensor(list(ids), dtype=torch.long)
        n = flat.numel() // (seq_len + 1)
        return cls(flat[: n * (seq_len + 1)].view(n, seq_len + 1))

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Any, seq_len: int) -> TokenBlocks:
        """Tokenize `texts` with a Hugging Face tokenizer (or any callable returning
        `{"input_ids": [[...], ...]}`)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        eos = getattr(tokenizer, "eos_token_id", None)
        ids: list[int] = []
        for doc in encoded:
            ids += list(doc)
            if eos is not None:
                ids.append(int(eos))
        return cls.from_token_ids(ids, seq_len)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, seq_len: int) -> TokenBlocks:
        """A `.txt` file (documents separated by blank lines), a `.jsonl` file (one object
        with a "text" field per line) or a `.json` list of strings."""
        return cls.from_texts(read_texts(path), tokenizer, seq_len)


def read_texts(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text dataset {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{n}: JSON object has no 'text' field")
                texts.append(str(record["text"]))
    elif path.suffix == ".json":
        texts = json.loads(raw)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{path}: expected a JSON list of strings")
    else:
        texts = [doc.strip() for doc in raw.split("\n\n") if doc.strip()]
    if not texts:
        raise ValueError(f"{path}: no text found")
    return texts


class JobSampler:
    """A job's own stream of batches: random epochs over the blocks, seeded by the job, so
    the job sees the same data whether it trains alone or in a pack."""

    def __init__(self, blocks: TokenBlocks, job: LoraJobConfig) -> None:
        self.blocks = blocks
        self.batch_size = job.batch_size
        self._gen = torch.Generator().manual_seed(job.seed)
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next_batch(self) -> torch.Tensor:
        """`[batch_size, seq_len + 1]` token ids."""
        picked = []
        while len(picked) < self.batch_size:
            if self._pos >= self._order.numel():
                self._order = torch.randperm(len(self.blocks), generator=self._gen)
                self._pos = 0
            picked.append(int(self._order[self._pos]))
            self._pos += 1
        return self.blocks.blocks[picked]
