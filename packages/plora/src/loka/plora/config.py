"""What one LoRA job is, and how the packed layers are built."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

LLAMA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BACKENDS = ("auto", "triton", "loop")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class LoraJobConfig:
    """One LoRA fine-tuning configuration: its adapter shape, optimizer and length.

    Give the length as `steps` or as `tokens` (then steps = ceil(tokens / (batch_size *
    seq_len))). `seq_len` is the job's own tokens per sample; None takes the run's (the
    runner's and the planner's `seq_len`). Jobs of different lengths pack together (see
    `pack_rows`). `name` names the output folder, so it is restricted to letters, digits,
    `_`, `.` and `-`. `seed` fixes the adapter initialization and the job's data order, so a
    job trains the same whether it runs alone or in a pack.
    """

    name: str
    rank: int
    alpha: float
    lr: float
    batch_size: int
    steps: int | None = None
    tokens: int | None = None
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    seed: int = 0
    seq_len: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(f"name {self.name!r} must match {_NAME.pattern}")
        if not _is_int(self.rank) or self.rank < 1:
            problems.append(f"rank must be an integer >= 1, got {self.rank!r}")
        if not _positive(self.alpha):
            problems.append(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if not _positive(self.lr):
            problems.append(f"lr must be a finite number > 0, got {self.lr!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            problems.append(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if (self.steps is None) == (self.tokens is None):
            problems.append("give exactly one of steps and tokens")
        for key in ("steps", "tokens", "seq_len"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 1):
                problems.append(f"{key} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and not _positive(self.max_grad_norm):
            problems.append(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                problems.append(f"{key} must be in [0, 1), got {getattr(self, key)!r}")
        if problems:
            raise ValueError(f"LoRA job {self.name!r}: " + "; ".join(problems))

    @property
    def scale(self) -> float:
        """The LoRA scaling alpha / rank applied to the adapter's output."""
        return self.alpha / self.rank

    def length(self, seq_len: int) -> int:
        """Tokens per sample: the job's own `seq_len`, else the run's `seq_len`."""
        return self.seq_len or seq_len

    def num_steps(self, seq_len: int) -> int:
        if self.steps is not None:
            return self.steps
        return math.ceil(self.tokens / (self.batch_size * self.length(seq_len)))

    def tokens_per_step(self, seq_len: int) -> int:
        """The job's own tokens per step (without the padding a pack may add: `pack_rows`)."""
        return self.batch_size * self.length(seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraJobConfig:
        """Build from a mapping (a JSON/YAML/CSV row); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"LoRA job {data.get('name')!r}: unknown keys {unknown}; known: {sorted(known)}"
            )
        clean = {k: v for k, v in data.items() if v is not None and v == v}  # drop NaN cells
        for key in ("rank", "batch_size", "steps", "tokens", "seed", "seq_len"):
            if key in clean and isinstance(clean[key], float) and clean[key].is_integer():
                clean[key] = int(clean[key])
        return cls(**clean)


@dataclass(frozen=True)
class PackRows:
    """How a packed step lays out the samples of jobs of different lengths.

    Every row of the packed batch is `row_len` tokens long (the longest job's length). Job i
    puts `samples_per_row[i]` of its samples (`row_len // length_i`) one after another in
    each of its `rows[i]` rows, the row's tail padded; a row never mixes jobs, so each job
    owns one contiguous token segment, which is what the multi-LoRA kernels take. Position
    ids restart at every sample, and attention stays within a sample (Hugging Face's packed
    sequences; pads sit after the samples, causal attention never lets a real token see
    them, and they are left out of the loss), so each job's gradient is the one it gets
    alone at its own length. With one length this is the plain `[batch, seq_len]` batch.
    """

    row_len: int
    samples_per_row: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        """Tokens each job occupies in the packed batch (its samples and its rows' pads)."""
        return tuple(r * self.row_len for r in self.rows)

    @property
    def shares_rows(self) -> bool:
        """Whether some row holds more than one sample (attention then needs a mask)."""
        return any(k > 1 for k in self.samples_per_row)


def pack_rows(jobs: Sequence[LoraJobConfig], seq_len: int) -> PackRows:
    """The `PackRows` of jobs training together (`seq_len`: the length of jobs without one)."""
    lengths = [job.length(seq_len) for job in jobs]
    row_len = max(lengths, default=seq_len)
    per_row = tuple(row_len // length for length in lengths)
    rows = tuple(-(-job.batch_size // k) for job, k in zip(jobs, per_row, strict=True))
    return PackRows(row_len, per_row, rows)


@dataclass(frozen=True)
class PackedLoraConfig:
    """How `convert_to_packed_lora` builds the packed layers.

    target_modules: a linear whose name ends in one of these (at a `.` boundary) gets the
    packed adapters (the default names cover Llama, Mistral and Qwen2 style models).
    backend: "triton" (segmented kernels), "loop" (a Python loop over adapters with plain
    torch ops), or "auto" (triton where the kernels can run: a CUDA GPU, or the CPU under
    TRITON_INTERPRET=1; otherwise loop).
    adapter_dtype: dtype of the adapter parameters and their optimizer state; the adapter
    GEMMs run in the activations' dtype.
    """

    target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES
    backend: str = "auto"
    adapter_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module")
        if not self.adapter_dtype.is_floating_point:
            raise ValueError(f"adapter_dtype must be a floating dtype, got {self.adapter_dtype}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0
