"""Which tokens and which rank rows of a packed batch belong to each LoRA adapter."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class MultiLoraLayout:
    """Token segments and rank slices of N adapters in a packed batch.

    Adapter i owns rows `[token_starts[i], token_ends[i])` of the flattened `[T, K]` input
    (empty segments are allowed: that adapter gets zero gradients) and rows
    `[rank_offsets[i], rank_offsets[i] + ranks[i])` of `a_cat` (columns of `b_cat`).
    Segments must be disjoint and cover all T tokens. Build one per batch with
    `from_token_counts` or `from_segments`; it is shared by every layer of the model.
    """

    token_starts: tuple[int, ...]
    token_ends: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    device: torch.device
    rank_offsets: tuple[int, ...] = field(init=False)
    meta: torch.Tensor = field(init=False, repr=False)  # int32 [4, N] on device
    scale_tensor: torch.Tensor = field(init=False, repr=False)  # float32 [N] on device
    token_blocks: int = field(init=False, repr=False)  # sum over adapters of ceil(n_i / 64)
    _chunk_cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if n == 0:
            raise ValueError("MultiLoraLayout needs at least one adapter")
        if not (len(self.token_starts) == len(self.token_ends) == len(self.scales) == n):
            raise ValueError(
                f"token_starts ({len(self.token_starts)}), token_ends ({len(self.token_ends)}), "
                f"ranks ({n}) and scales ({len(self.scales)}) must have one entry per adapter"
            )
        for i, (r, s) in enumerate(zip(self.ranks, self.scales, strict=True)):
            if int(r) < 1:
                raise ValueError(f"adapter {i}: rank must be >= 1, got {r}")
            if not math.isfinite(float(s)):
                raise ValueError(f"adapter {i}: scale must be finite, got {s}")
        spans = sorted(zip(self.token_starts, self.token_ends, strict=True))
        cursor = 0
        for start, end in spans:
            if end < start:
                raise ValueError(f"token segment [{start}, {end}) has negative length")
            if start == end:
                continue
            if start != cursor:
                raise ValueError(
                    f"token segments must be disjoint and cover [0, T) without gaps; "
                    f"segment [{start}, {end}) starts at {start}, expected {cursor}"
                )
            cursor = end
        offsets, total = [], 0
        for r in self.ranks:
            offsets.append(total)
            total += int(r)
        object.__setattr__(self, "rank_offsets", tuple(offsets))
        blocks = sum(
            -(-(e - s) // 64) for s, e in zip(self.token_starts, self.token_ends, strict=True)
        )
        object.__setattr__(self, "token_blocks", blocks)
        host = torch.tensor(
            [list(self.token_starts), list(self.token_ends), list(self.ranks), offsets],
            dtype=torch.int32,
        )
        object.__setattr__(self, "meta", host.to(self.device, non_blocking=True))
        object.__setattr__(
            self,
            "scale_tensor",
            torch.tensor(self.scales, dtype=torch.float32).to(self.device, non_blocking=True),
        )

    @classmethod
    def from_token_counts(
        cls,
        tokens_per_adapter: Sequence[int],
        ranks: Sequence[int],
        scales: Sequence[float],
        device: torch.device | str = "cpu",
    ) -> MultiLoraLayout:
        """Adapters' tokens follow each other in adapter order: adapter 0 first."""
        starts, ends, cursor = [], [], 0
        for i, count in enumerate(tokens_per_adapter):
            if int(count) < 0:
                raise ValueError(f"adapter {i}: token count must be >= 0, got {count}")
            starts.append(cursor)
            cursor += int(count)
            ends.append(cursor)
        return cls(
            tuple(starts),
            tuple(ends),
            tuple(int(r) for r in ranks),
            tuple(float(s) for s in scales),
            torch.device(device),
        )

    @classmethod
    def from_segments(
        cls,
        token_starts: Sequence[int],
        token_ends: Sequence[int],
        ranks: Sequence[int],
        scales: Sequence[float],
        device: torch.device | str = "cpu",
    ) -> MultiLoraLayout:
        return cls(
            tuple(int(s) for s in token_starts),
            tuple(int(e) for e in token_ends),
            tuple(int(r) for r in ranks),
            tuple(float(s) for s in scales),
            torch.device(device),
        )

    @property
    def num_adapters(self) -> int:
        return len(self.ranks)

    @property
    def num_tokens(self) -> int:
        return max(self.token_ends)

    @property
    def max_segment(self) -> int:
        return max(e - s for s, e in zip(self.token_starts, self.token_ends, strict=True))

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def total_rank(self) -> int:
        return sum(self.ranks)

    def tokens_of(self, adapter: int) -> int:
        return self.token_ends[adapter] - self.token_starts[adapter]

    def token_chunks(self, chunk_tokens: int) -> TokenChunks:
        """Each adapter's segment cut into runs of at most `chunk_tokens` tokens (the split
        wgrad's unit of work), cached per chunk size: the layout serves every layer."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        cached = self._chunk_cache.get(chunk_tokens)
        if cached is None:
            cached = self._chunk_cache[chunk_tokens] = TokenChunks.build(self, chunk_tokens)
        return cached

    def segment(self, adapter: int) -> tuple[int, int, int, int]:
        """(first token, end token, rank, rank offset) of `adapter`."""
        return (
            self.token_starts[adapter],
            self.token_ends[adapter],
            self.ranks[adapter],
            self.rank_offsets[adapter],
        )


@dataclass(frozen=True, eq=False)
class TokenChunks:
    """Adapters' token segments cut into chunks, in adapter order (one adapter's chunks are
    consecutive). `chunk_meta` (int32 [4, C] on device): adapter, first token, end token and
    first row in the split wgrad's fp32 partial buffer (rows: the chunk's adapter's rank) of
    each chunk; `adapter_meta` (int32 [2, N]): each adapter's first partial row and chunk
    count. `partial_rows`: the partial buffer's row count (sum over chunks of their rank)."""

    num_chunks: int
    partial_rows: int
    chunk_meta: torch.Tensor
    adapter_meta: torch.Tensor

    @classmethod
    def build(cls, layout: MultiLoraLayout, chunk_tokens: int) -> TokenChunks:
        adapters, starts, ends, rows = [], [], [], []
        first_row, counts, row = [], [], 0
        for i in range(layout.num_adapters):
            s, e, r, _ = layout.segment(i)
            first_row.append(row)
            count = 0
            for c in range(s, e, chunk_tokens):
                adapters.append(i)
                starts.append(c)
                ends.append(min(c + chunk_tokens, e))
                rows.append(row)
                row += r
                count += 1
            counts.append(count)
        chunk_meta = torch.tensor([adapters, starts, ends, rows], dtype=torch.int32)
        if not adapters:
            chunk_meta = torch.zeros(4, 1, dtype=torch.int32)
        adapter_meta = torch.tensor([first_row, counts], dtype=torch.int32)
        device = layout.device
        return cls(
            len(adapters),
            row,
            chunk_meta.to(device, non_blocking=True),
            adapter_meta.to(device, non_blocking=True),
        )
