"""The packed multi-LoRA linear: one frozen base GEMM, N adapters over token segments."""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence

import torch
from torch import nn

from loka.plora.config import LoraJobConfig
from loka.plora.kernels import (
    MultiLoraLayout,
    multi_lora_base_linear,
    multi_lora_kernels_available,
    multi_lora_linear,
    multi_lora_linear_reference,
)


class PackedBatch:
    """The current batch's token layout, shared by every packed layer of one model."""

    def __init__(self) -> None:
        self.layout: MultiLoraLayout | None = None

    def require(self, num_tokens: int, where: str) -> MultiLoraLayout:
        if self.layout is None:
            raise RuntimeError(
                f"{where}: no packed batch is set; call PackedLora.set_batch(...) before forward"
            )
        if self.layout.num_tokens != num_tokens:
            raise ValueError(
                f"{where}: input has {num_tokens} tokens but the packed batch set with "
                f"set_batch has {self.layout.num_tokens}"
            )
        return self.layout


class AdapterAliases:
    """One leaf parameter per adapter, each aliasing the adapter's rows of a packed parameter.

    The packed parameter is what the model computes with (one autograd leaf, one gradient
    accumulation a step for every adapter together); the aliases are what per-job
    optimizers step: `params[i]` shares storage with rows `bounds[i]` of `packed`, and
    `sync()` points its `.grad` at the same rows of `packed.grad` (it runs after every
    gradient accumulation into `packed`, and before an optimizer step). The binding is
    redone only when the packed storage or gradient tensor changed (a `.to()`, a gradient
    set to None and made anew), so an optimizer's state, keyed by the alias objects,
    survives.
    """

    def __init__(self, packed: nn.Parameter, bounds: Sequence[tuple[int, int]]) -> None:
        self.packed = packed
        self.bounds = tuple(bounds)
        data = packed.detach()
        self.params = [nn.Parameter(data[a:b]) for a, b in self.bounds]
        self._data_key = _storage_key(data)
        self._grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor | None] = [None] * len(self.bounds)
        # Bound as soon as a backward makes the packed gradient, so an alias's `.grad` is
        # current for any optimizer or reader, not only after `sync()`.
        packed.register_post_accumulate_grad_hook(lambda _: self.sync())

    def sync(self) -> None:
        data = self.packed.detach()
        if _storage_key(data) != self._data_key:
            for param, (a, b) in zip(self.params, self.bounds, strict=True):
                param.data = data[a:b]
                param.grad = None
            self._data_key = _storage_key(data)
            self._grad = None
            self._grad_views = [None] * len(self.bounds)
        grad = self.packed.grad
        if grad is not None and grad is not self._grad:
            views = [grad[a:b] for a, b in self.bounds]
            for param, view in zip(self.params, views, strict=True):
                param.grad = view
            self._grad, self._grad_views = grad, views
        elif grad is None and self._grad is not None:
            self._grad, self._grad_views = None, [None] * len(self.bounds)
            for param in self.params:
                param.grad = None

    def zero_grad(self) -> torch.Tensor | None:
        """Drops gradients set on an alias by hand (not views of the packed gradient);
        returns the packed gradient for the caller to zero in place (None: none yet)."""
        for k, param in enumerate(self.params):
            if param.grad is not None and param.grad is not self._grad_views[k]:
                param.grad = None
        return self._grad


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.device, t.dtype)


class PackedLoraLinear(nn.Module):
    """`y = base(x) + s_i (x A_i^T) B_i^T` for the tokens of adapter i.

    The base linear runs once over all tokens and stays frozen. Every adapter's factors
    live in two packed parameters, `lora_packed_A: [sum r, in]` (adapter i's `A_i` in rows
    `offsets[i]:offsets[i] + r_i`) and `lora_packed_Bt: [sum r, out]` (`B_i^T` in the same
    rows), so a step accumulates two gradients per linear however many jobs it packs, and
    the op reads them with no concatenation. `lora_A[i]` (`[r_i, in]`) and `lora_B[i]`
    (`[out, r_i]`, peft's orientation) are detached views of them (write them under
    `torch.no_grad()` to set an adapter); `adapter_parameters(i)` gives the per-job
    optimizer leaf parameters aliasing the same rows, gradients included (`AdapterAliases`).
    A starts like peft's (uniform in +-1/sqrt(in)) from a generator seeded by the job's seed
    and this module's name; B starts at zero.
    """

    def __init__(
        self,
        base: nn.Linear,
        jobs: Sequence[LoraJobConfig],
        batch: PackedBatch,
        *,
        name: str,
        backend: str,
        adapter_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"{name}: packed LoRA wraps nn.Linear, got {type(base).__name__}")
        self.base = base
        self.name = name
        self.batch = batch
        self.backend = backend
        self.scales = tuple(job.scale for job in jobs)
        self.ranks = tuple(job.rank for job in jobs)
        starts = [0]
        for rank in self.ranks:
            starts.append(starts[-1] + rank)
        self.offsets = tuple(starts[:-1])
        bounds = list(itertools.pairwise(starts))
        device = base.weight.device
        bound = 1.0 / math.sqrt(base.in_features)
        a_rows = []
        for job in jobs:
            gen = torch.Generator().manual_seed(job.seed * 1_000_003 + zlib.crc32(name.encode()))
            a_rows.append((torch.rand(job.rank, base.in_features, generator=gen) * 2 - 1) * bound)
        self.lora_packed_A = nn.Parameter(torch.cat(a_rows).to(device, adapter_dtype))
        self.lora_packed_Bt = nn.Parameter(
            torch.zeros(starts[-1], base.out_features, device=device, dtype=adapter_dtype)
        )
        self.aliases_A = AdapterAliases(self.lora_packed_A, bounds)
        self.aliases_Bt = AdapterAliases(self.lora_packed_Bt, bounds)

    @property
    def lora_A(self) -> tuple[torch.Tensor, ...]:
        """Each adapter's `A_i: [r_i, in]`, a detached view of `lora_packed_A`."""
        data = self.lora_packed_A.detach()
        return tuple(data[o : o + r] for o, r in zip(self.offsets, self.ranks, strict=True))

    @property
    def lora_B(self) -> tuple[torch.Tensor, ...]:
        """Each adapter's `B_i: [out, r_i]`, a detached (transposed) view of `lora_packed_Bt`."""
        data = self.lora_packed_Bt.detach()
        return tuple(data[o : o + r].t() for o, r in zip(self.offsets, self.ranks, strict=True))

    def adapter_parameters(self, index: int) -> list[nn.Parameter]:
        """Adapter `index`'s optimizer leaves: `[A_i (r_i x in), B_i^T (r_i x out)]`,
        aliasing the packed rows, their `.grad` the same rows of the packed gradients."""
        self.sync_aliases()
        return [self.aliases_A.params[index], self.aliases_Bt.params[index]]

    def sync_aliases(self) -> None:
        self.aliases_A.sync()
        self.aliases_Bt.sync()

    # Under torch.compile the packed op runs eagerly between compiled regions (one graph
    # break per packed linear): the base model's norms, activations, attention and loss
    # compile and fuse around it, while Dynamo never traces the kernels' launchers (it
    # failed inside them) nor guards on the batch layout, which changes with every pack.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        use_triton = self._use_triton(x.device)
        if use_triton and self._base_fusable(x):
            # The base GEMM and the adapters as one op: the adapters add into the base's
            # output and input gradient in place (multi_lora_base_linear), reading the
            # packed factors as they are (B^T's transpose is a view: the kernels take strides).
            layout = self.batch.require(x2.shape[0], self.name)
            y = multi_lora_base_linear(
                x2,
                self.base.weight,
                self.base.bias,
                self.lora_packed_A,
                self.lora_packed_Bt.t(),
                layout,
            )
            return y.view(*x.shape[:-1], y.shape[-1])
        base_out = self.base(x)
        layout = self.batch.require(x2.shape[0], self.name)
        out2 = base_out.reshape(-1, base_out.shape[-1])
        if use_triton:
            a_cat, b_cat = self._packed_factors(x.dtype)
            y = multi_lora_linear(x2, out2, a_cat, b_cat, layout)
        else:
            a_list = self.lora_packed_A.to(x.dtype).split(self.ranks)
            b_list = [bt.t() for bt in self.lora_packed_Bt.to(x.dtype).split(self.ranks)]
            y = multi_lora_linear_reference(x2, out2, a_list, b_list, layout)
        return y.view(base_out.shape)

    def _packed_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_cat [sum r, in], B_cat [out, sum r]) in `dtype`: the packed parameters
        themselves when already in `dtype` (B_cat a transposed view), else one cast each."""
        return self.lora_packed_A.to(dtype), self.lora_packed_Bt.t().to(dtype)

    def _base_fusable(self, x: torch.Tensor) -> bool:
        """Whether the base linear can run inside the packed op: a plain nn.Linear without
        hooks, in x's dtype, outside autocast (else it runs as itself, then the adapters)."""
        base = self.base
        return (
            type(base) is nn.Linear
            and not (base._forward_hooks or base._forward_pre_hooks)
            and base.weight.dtype == x.dtype
            and (base.bias is None or base.bias.dtype == x.dtype)
            and not torch.is_autocast_enabled(x.device.type)
        )

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "auto":
            return multi_lora_kernels_available(device)
        return self.backend == "triton"

    def extra_repr(self) -> str:
        return (
            f"in={self.base.in_features}, out={self.base.out_features}, ranks={self.ranks}, "
            f"backend={self.backend}"
        )
