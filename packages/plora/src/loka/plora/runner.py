"""Train planned packs of LoRA jobs on a Hugging Face causal LM, one peft adapter per job."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from loka.plora.checkpoint import save_adapter
from loka.plora.config import LoraJobConfig, PackedLoraConfig, pack_rows
from loka.plora.data import JobSampler, TokenBlocks, read_texts
from loka.plora.model import PackedLora, convert_to_packed_lora
from loka.plora.optim import AdapterStep, PerAdapterOptimizer


@dataclass(frozen=True)
class RunnerConfig:
    """seq_len: tokens per sample (of jobs without their own `seq_len`; a job's own may only
    be shorter: the data is cut into blocks of this length); dtype: the base model's dtype
    when loaded from a path; device: where to train (default: CUDA when available);
    save_optimizer: also write each job's AdamW state next to its adapter, to resume;
    compile: run each step's forward and token loss through `torch.compile` (`compiled_loss`:
    the packed linears run eagerly between compiled regions)."""

    seq_len: int = 512
    packed: PackedLoraConfig = field(default_factory=PackedLoraConfig)
    dtype: torch.dtype = torch.bfloat16
    device: str | None = None
    save_optimizer: bool = False
    compile: bool = False


@dataclass
class JobResult:
    """How one job ended: "done" (all its steps) or "diverged" (stopped at a non-finite
    loss or gradient; its adapter keeps the last finite weights)."""

    name: str
    pack: int
    status: str
    steps: int
    tokens: int
    final_loss: float | None
    losses: list[float]
    adapter_dir: str | None
    wall_s: float
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepProfile:
    """One measured packed step: the record the planner's throughput model is fit on."""

    n_adapters: int
    tokens: int
    rank_tokens: int  # sum over adapters of rank x tokens
    step_time_s: float
    peak_memory_bytes: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# (model, input ids, labels, extra model inputs) -> per-token loss
TokenLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def token_losses(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The causal LM's cross-entropy per token (flattened; 0 at the pads, label -100)."""
    logits = model(input_ids=input_ids, use_cache=False, **extra).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")


def compiled_loss(**compile_kwargs: Any) -> TokenLoss:
    """`token_losses` under `torch.compile` (keyword arguments passed on): the base model's
    norms, activations, attention and the loss's float32 logits compile and fuse, while each
    `PackedLoraLinear` runs eagerly between the compiled regions (a graph break per packed
    linear; its layout changes with every pack, and Dynamo does not trace the kernels'
    launchers). Each new pack composition (another token count) may compile once more."""
    return torch.compile(token_losses, **compile_kwargs)


def packed_train_step(
    packed: PackedLora,
    optimizer: PerAdapterOptimizer,
    batches: Sequence[tuple[int, torch.Tensor]],
    *,
    loss_fn: TokenLoss = token_losses,
) -> tuple[list[float], list[AdapterStep]]:
    """One forward/backward/step over the batches of several adapters at once.

    batches: `(adapter index, [b, length + 1] token ids)` per active adapter; lengths may
    differ between adapters (laid out as `loka.plora.config.pack_rows` says). Each
    adapter's loss is the mean token cross-entropy over its own samples, and the summed
    loss gives each adapter exactly the gradient of its own loss. Returns the per-adapter
    losses (NaN for adapters not in the batch) and the optimizer's report. `loss_fn`:
    `token_losses`, or `compiled_loss()`.
    """
    device = packed.device
    inputs, labels, positions, owners = _packed_rows(batches)
    row_len = inputs.shape[1]
    packed.set_batch(owners, row_len)
    active = [i for i, _ in batches]
    # The phases are labelled for torch.profiler (bench/plora.py --sections profile).
    try:
        with record_function("plora.forward"):
            # One copy to the device for inputs and labels (and positions when rows are shared).
            staged = torch.stack([inputs, labels] + ([] if positions is None else [positions]))
            on_device = staged.to(device, non_blocking=True)
            inputs, labels = on_device[0], on_device[1]
            extra = {} if positions is None else {"position_ids": on_device[2]}
            token_loss = loss_fn(packed.model, inputs, labels, extra)
            owner = torch.tensor(owners, device=device).repeat_interleave(row_len)
            n = packed.num_adapters
            sums = torch.zeros(n, device=device).index_add(0, owner, token_loss)
            real = (labels.flatten() != _PAD_LABEL).float()
            counts = torch.zeros(n, device=device).index_add(0, owner, real)
            losses = sums / counts.clamp_min(1)
        with record_function("plora.backward"):
            losses[active].sum().backward()
    except BaseException:
        optimizer.zero_grad()  # a half-done backward must not leak into the next step
        raise
    with record_function("plora.optimizer"):
        reports = optimizer.step(active)
    with record_function("plora.readback"):
        host = losses.detach().cpu().tolist()
    present = set(active)
    return [v if i in present else math.nan for i, v in enumerate(host)], reports


_PAD_LABEL = -100  # cross_entropy's ignore_index


def _packed_rows(
    batches: Sequence[tuple[int, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """Input ids, labels, position ids (None: one sample per row, no padding) and the
    adapter of each row: each adapter's samples `row_len // length` to a row (`PackRows`)."""
    lengths = [ids.shape[1] - 1 for _, ids in batches]
    if min(lengths) < 1:
        raise ValueError("packed_train_step: every sample needs at least 2 token ids")
    if len(set(lengths)) == 1:
        ids = torch.cat([b for _, b in batches])
        owners = [i for i, b in batches for _ in range(b.shape[0])]
        return ids[:, :-1], ids[:, 1:], None, owners
    row_len = max(lengths)
    inputs, labels, positions, owners = [], [], [], []
    for (i, ids), length in zip(batches, lengths, strict=True):
        per_row = row_len // length
        for start in range(0, ids.shape[0], per_row):
            chunk = ids[start : start + per_row]
            used = chunk.shape[0] * length
            row = torch.zeros(row_len, dtype=ids.dtype)
            label = torch.full((row_len,), _PAD_LABEL, dtype=ids.dtype)
            row[:used] = chunk[:, :-1].reshape(-1)
            label[:used] = chunk[:, 1:].reshape(-1)
            # Positions restart at each sample (attention stays within it); the pads
            # continue the last sample's, after it, where no real token attends.
            position = torch.cat(
                [torch.arange(length).repeat(chunk.shape[0]), torch.arange(row_len - used) + length]
            )
            inputs.append(row)
            labels.append(label)
            positions.append(position)
            owners.append(i)
    return torch.stack(inputs), torch.stack(labels), torch.stack(positions), owners


def train_packs(
    model: nn.Module | str | Path,
    jobs: Sequence[LoraJobConfig],
    packs: Sequence[Sequence[str]],
    data: TokenBlocks | Sequence[str] | str | Path,
    output_dir: str | Path,
    *,
    config: RunnerConfig | None = None,
    tokenizer: Any = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> list[JobResult]:
    """Train `jobs` pack by pack (`packs` lists job names; every job in exactly one pack).

    model: a causal LM module, or a local checkpoint folder (loaded with
    `AutoModelForCausalLM`, tokenizer from the same folder unless given). data: token
    blocks, a list of texts, or a text file (see `TokenBlocks.from_file`). Each job's adapter
    is written to `output_dir/<job name>/` in peft's format. A job that diverges stops and
    is reported; the other jobs of its pack train on. The model is left as it was.
    """
    config = config or RunnerConfig()
    by_name = _check_packs(jobs, packs)
    longer = [job.name for job in jobs if job.length(config.seq_len) > config.seq_len]
    if longer:
        raise ValueError(
            f"jobs {longer} have a seq_len above the runner's seq_len {config.seq_len}; "
            "the data is cut into blocks of the runner's seq_len: raise it to the longest job's"
        )
    model, tokenizer, source = _load_model(model, tokenizer, config)
    blocks = _load_data(data, tokenizer, config.seq_len)
    output_dir = Path(output_dir)
    results: list[JobResult] = []
    for p, names in enumerate(packs):
        pack_jobs = [by_name[name] for name in names]
        results += _train_pack(model, pack_jobs, p, blocks, output_dir, config, source, on_step)
    return results


def _train_pack(model, jobs, pack, blocks, output_dir, config, source, on_step) -> list[JobResult]:
    packed = convert_to_packed_lora(model, jobs, config.packed)
    loss_fn = compiled_loss() if config.compile else token_losses
    try:
        optimizer = PerAdapterOptimizer(packed)
        samplers = [JobSampler(blocks, job) for job in jobs]
        lengths = [job.length(config.seq_len) for job in jobs]
        remaining = [job.num_steps(config.seq_len) for job in jobs]
        losses: list[list[float]] = [[] for _ in jobs]
        status = ["running"] * len(jobs)
        reasons = [""] * len(jobs)
        finished = [0.0] * len(jobs)
        start, step = time.perf_counter(), 0
        while True:
            active = [i for i in range(len(jobs)) if remaining[i] > 0 and status[i] == "running"]
            if not active:
                break
            batches = [(i, samplers[i].next_batch()[:, : lengths[i] + 1]) for i in active]
            step_losses, reports = packed_train_step(packed, optimizer, batches, loss_fn=loss_fn)
            now = time.perf_counter() - start
            for report in reports:
                i, loss = report.index, step_losses[report.index]
                if not report.stepped or not math.isfinite(loss):
                    status[i], finished[i] = "diverged", now
                    reasons[i] = report.reason or f"non-finite loss {loss}"
                    continue
                losses[i].append(loss)
                remaining[i] -= 1
                if remaining[i] == 0:
                    status[i], finished[i] = "done", now
            step += 1
            if on_step is not None:
                on_step(pack, step, {jobs[i].name: step_losses[i] for i in active})
        results = []
        for i, job in enumerate(jobs):
            result = JobResult(
                name=job.name,
                pack=pack,
                status=status[i],
                steps=len(losses[i]),
                tokens=len(losses[i]) * job.tokens_per_step(config.seq_len),
                final_loss=losses[i][-1] if losses[i] else None,
                losses=losses[i],
                adapter_dir=None,
                wall_s=finished[i],
                reason=reasons[i],
            )
            folder = save_adapter(
                packed,
                i,
                output_dir / job.name,
                optimizer=optimizer if config.save_optimizer else None,
                base_model_name_or_path=source,
                metrics=result.to_dict(),
            )
            result.adapter_dir = str(folder)
            results.append(result)
        return results
    finally:
        packed.remove()


def profile_pack(
    model: nn.Module,
    jobs: Sequence[LoraJobConfig],
    seq_len: int,
    *,
    config: PackedLoraConfig | None = None,
    steps: int = 3,
    warmup: int = 1,
    compile: bool = False,
) -> StepProfile:
    """Time packed training steps of `jobs` (all active, random tokens) on the model's
    device; the model is left as it was. Feeds the planner's throughput model. `compile`:
    time the steps as `RunnerConfig(compile=True)` runs them. The warm-up is at least what
    keeps one-off work out of the timed steps: the compile, the optimizer's graph capture."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().num_embeddings)
    packed = convert_to_packed_lora(model, jobs, config)
    try:
        optimizer = PerAdapterOptimizer(packed)
        gen = torch.Generator().manual_seed(0)
        batches = [
            (i, torch.randint(0, vocab, (job.batch_size, job.length(seq_len) + 1), generator=gen))
            for i, job in enumerate(jobs)
        ]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss_fn = compiled_loss() if compile else token_losses
        # Untimed: the compile (its first step) and, on CUDA, the optimizer's graph capture
        # (its second: `PerAdapterOptimizer(graphs=...)`).
        least = 2 if optimizer.graphs else 1 if compile else 0
        for _ in range(max(warmup, least)):
            packed_train_step(packed, optimizer, batches, loss_fn=loss_fn)
        _sync(device)
        begin = time.perf_counter()
        for _ in range(steps):
            packed_train_step(packed, optimizer, batches, loss_fn=loss_fn)
        _sync(device)
        elapsed = (time.perf_counter() - begin) / steps
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    finally:
        packed.remove()
    tokens = pack_rows(jobs, seq_len).tokens  # what the step processed, pads included
    return StepProfile(
        n_adapters=len(jobs),
        tokens=sum(tokens),
        rank_tokens=sum(job.rank * t for job, t in zip(jobs, tokens, strict=True)),
        step_time_s=elapsed,
        peak_memory_bytes=int(peak),
        device=str(device),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_packs(
    jobs: Sequence[LoraJobConfig], packs: Sequence[Sequence[str]]
) -> dict[str, LoraJobConfig]:
    by_name = {job.name: job for job in jobs}
    if len(by_name) != len(jobs):
        raise ValueError("job names must be unique")
    placed = [name for pack in packs for name in pack]
    unknown = sorted(set(placed) - set(by_name))
    twice = sorted({name for name in placed if placed.count(name) > 1})
    missing = sorted(set(by_name) - set(placed))
    if unknown or twice or missing or any(not pack for pack in packs):
        raise ValueError(
            f"packs must place every job exactly once and be non-empty: unknown {unknown}, "
            f"placed twice {twice}, not placed {missing}"
        )
    return by_name


def _load_model(model, tokenizer, config: RunnerConfig):
    if isinstance(model, nn.Module):
        return model, tokenizer, getattr(getattr(model, "config", None), "_name_or_path", None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; give a local Hugging Face checkpoint")
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=config.dtype).to(device)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return loaded, tokenizer, str(path)


def _load_data(data, tokenizer, seq_len: int) -> TokenBlocks:
    if isinstance(data, TokenBlocks):
        if data.seq_len != seq_len:
            raise ValueError(f"token blocks have seq_len {data.seq_len}, the runner {seq_len}")
        return data
    if tokenizer is None:
        raise ValueError("text data needs a tokenizer (or a model folder that has one)")
    texts = read_texts(data) if isinstance(data, str | Path) else list(data)
    return TokenBlocks.from_texts(texts, tokenizer, seq_len)
