"""Put packed multi-LoRA layers into a model, feed them a batch layout, take them out again."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loka.plora.config import LoraJobConfig, PackedLoraConfig
from loka.plora.kernels import MultiLoraLayout
from loka.plora.layer import PackedBatch, PackedLoraLinear

# peft's key prefix for a model wrapped by PeftModel (saved without the adapter name).
PEFT_PREFIX = "base_model.model."


class PackedLora:
    """Handle on a model whose target linears carry N packed adapters (one per job).

    `set_batch` tells every layer which samples belong to which adapter; `remove` puts the
    original linears back and restores the base parameters' `requires_grad` flags.
    """

    def __init__(
        self,
        model: nn.Module,
        jobs: Sequence[LoraJobConfig],
        config: PackedLoraConfig,
        modules: dict[str, PackedLoraLinear],
        batch: PackedBatch,
        requires_grad: dict[str, bool],
    ) -> None:
        self.model = model
        self.jobs = tuple(jobs)
        self.config = config
        self.modules = modules
        self._batch = batch
        self._requires_grad = requires_grad

    @property
    def num_adapters(self) -> int:
        return len(self.jobs)

    @property
    def device(self) -> torch.device:
        return next(iter(self.modules.values())).base.weight.device

    def index(self, name: str) -> int:
        for i, job in enumerate(self.jobs):
            if job.name == name:
                return i
        raise KeyError(f"no job named {name!r}; jobs: {[job.name for job in self.jobs]}")

    def set_batch(self, sample_adapters: Sequence[int], tokens_per_sample: int) -> MultiLoraLayout:
        """Declare the next batch: sample b (of `tokens_per_sample` tokens) trains adapter
        `sample_adapters[b]`. One adapter's samples must be consecutive. Nothing changes if
        the ids are invalid."""
        ids = [int(i) for i in sample_adapters]
        if not ids:
            raise ValueError("set_batch: the batch has no samples")
        if tokens_per_sample < 1:
            raise ValueError(f"set_batch: tokens_per_sample must be >= 1, got {tokens_per_sample}")
        bad = [(b, i) for b, i in enumerate(ids) if not 0 <= i < self.num_adapters]
        if bad:
            b, i = bad[0]
            raise ValueError(
                f"set_batch: adapter id {i} (sample {b}) is out of range for "
                f"{self.num_adapters} adapters; {len(bad)} sample(s) affected"
            )
        starts = [0] * self.num_adapters
        ends = [0] * self.num_adapters
        seen: set[int] = set()
        for b, i in enumerate(ids):
            if b > 0 and ids[b - 1] == i:
                continue
            if i in seen:
                raise ValueError(
                    f"set_batch: samples of adapter {i} are not consecutive (again at sample "
                    f"{b}); group each adapter's samples together"
                )
            seen.add(i)
            starts[i] = b * tokens_per_sample
            run = next((c for c in range(b, len(ids)) if ids[c] != i), len(ids))
            ends[i] = run * tokens_per_sample
        # An adapter without samples gets an empty segment placed at the end.
        total = len(ids) * tokens_per_sample
        for i in range(self.num_adapters):
            if i not in seen:
                starts[i] = ends[i] = total
        layout = MultiLoraLayout.from_segments(
            starts, ends, [j.rank for j in self.jobs], [j.scale for j in self.jobs], self.device
        )
        self._batch.layout = layout
        return layout

    def adapter_parameters(self, index: int) -> list[nn.Parameter]:
        """One adapter's optimizer leaves, in module order (`A_i` `[r, in]`, then `B_i^T`
        `[r, out]` per module): parameters aliasing its rows of the packed factors, their
        `.grad` bound to the same rows of the packed gradients (`AdapterAliases`)."""
        self.check_index(index)
        params: list[nn.Parameter] = []
        for module in self.modules.values():
            params += module.adapter_parameters(index)
        return params

    def sync_adapter_parameters(self) -> None:
        """Re-point every adapter's aliases at the packed storage and gradients where those
        changed (after a backward that made new gradients, or a `.to()`)."""
        for module in self.modules.values():
            module.sync_aliases()

    def packed_gradients(self) -> list[torch.Tensor]:
        """The packed factors' gradients that exist (two per module after a backward),
        each alias's hand-set gradient dropped: what `zero_grad` zeroes in place."""
        grads = []
        for module in self.modules.values():
            for aliases in (module.aliases_A, module.aliases_Bt):
                aliases.sync()
                grad = aliases.zero_grad()
                if grad is not None:
                    grads.append(grad)
        return grads

    def adapter_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """One adapter's weights under peft's key names (contiguous copies on the CPU)."""
        self.check_index(index)
        state = {}
        for name, module in self.modules.items():
            for key, factor in (("lora_A", module.lora_A[index]), ("lora_B", module.lora_B[index])):
                copy = factor.to("cpu", copy=True).contiguous()
                state[f"{PEFT_PREFIX}{name}.{key}.weight"] = copy
        return state

    def load_adapter_state_dict(self, index: int, state: dict[str, torch.Tensor]) -> None:
        """Copy peft-named weights into one adapter; every key and shape is checked first,
        so a mismatched checkpoint changes nothing."""
        self.check_index(index)
        job = self.jobs[index]
        expected = {}
        for name, module in self.modules.items():
            expected[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A[index]
            expected[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B[index]
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"adapter {job.name!r}: checkpoint keys do not match the packed modules; "
                f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
            )
        for key, param in expected.items():
            if tuple(state[key].shape) != tuple(param.shape):
                raise ValueError(
                    f"adapter {job.name!r} (rank {job.rank}): checkpoint tensor {key} has shape "
                    f"{tuple(state[key].shape)}, the adapter needs {tuple(param.shape)}"
                )
            if not torch.isfinite(state[key]).all():
                raise ValueError(f"adapter {job.name!r}: checkpoint tensor {key} has NaN or Inf")
        with torch.no_grad():
            for key, param in expected.items():
                param.copy_(state[key])

    def remove(self) -> nn.Module:
        """Put the original linears back; returns the model."""
        for name, module in self.modules.items():
            parent, child = _parent(self.model, name)
            setattr(parent, child, module.base)
        for name, param in self.model.named_parameters():
            if name in self._requires_grad:
                param.requires_grad_(self._requires_grad[name])
        self.modules = {}
        self._batch.layout = None
        return self.model

    def check_index(self, index: int) -> None:
        if not 0 <= index < self.num_adapters:
            raise IndexError(f"adapter index {index} out of range for {self.num_adapters} adapters")


def convert_to_packed_lora(
    model: nn.Module,
    jobs: Sequence[LoraJobConfig],
    config: PackedLoraConfig | None = None,
) -> PackedLora:
    """Freeze `model` and give each target linear one adapter per job (in job order).

    Nothing in the model changes if this raises (duplicate job names, no target module).
    """
    config = config or PackedLoraConfig()
    jobs = list(jobs)
    if not jobs:
        raise ValueError("convert_to_packed_lora needs at least one LoRA job")
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got {names}")
    targets = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and any(name == t or name.endswith("." + t) for t in config.target_modules)
    }
    if not targets:
        raise ValueError(
            f"no nn.Linear in the model matches target_modules {list(config.target_modules)}"
        )
    batch = PackedBatch()
    packed_modules = {
        name: PackedLoraLinear(
            module,
            jobs,
            batch,
            name=name,
            backend=config.backend,
            adapter_dtype=config.adapter_dtype,
        )
        for name, module in targets.items()
    }
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in packed_modules.items():
        parent, child = _parent(model, name)
        setattr(parent, child, module)
    return PackedLora(model, jobs, config, packed_modules, batch, requires_grad)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child
