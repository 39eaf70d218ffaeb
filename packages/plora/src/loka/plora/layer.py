"""The packed multi-LoRA linear: one frozen base GEMM, N adapters over token segments."""

from __future__ import annotations

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
from loka.plora.kernels.function import cat_factors


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


class PackedLoraLinear(nn.Module):
    """`y = base(x) + s_i (x A_i^T) B_i^T` for the tokens of adapter i.

    The base linear runs once over all tokens and stays frozen; each adapter has its own
    parameters `lora_A[i]: [r_i, in]` and `lora_B[i]: [out, r_i]` (so each job keeps its
    own optimizer state). A starts like peft's (uniform in +-1/sqrt(in)) from a generator
    seeded by the job's seed and this module's name; B starts at zero.
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
        device = base.weight.device
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for job in jobs:
            gen = torch.Generator().manual_seed(job.seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(base.in_features)
            a = (torch.rand(job.rank, base.in_features, generator=gen) * 2 - 1) * bound
            self.lora_A.append(nn.Parameter(a.to(device, adapter_dtype)))
            b = torch.zeros(base.out_features, job.rank, device=device, dtype=adapter_dtype)
            self.lora_B.append(nn.Parameter(b))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(a.shape[0] for a in self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        use_triton = self._use_triton(x.device)
        if use_triton and self._base_fusable(x):
            # The base GEMM and the adapters as one op: the adapters add into the base's
            # output and input gradient in place (multi_lora_base_linear).
            layout = self.batch.require(x2.shape[0], self.name)
            # Each adapter's own parameters: the op concatenates and casts them itself.
            y = multi_lora_base_linear(
                x2, self.base.weight, self.base.bias, tuple(self.lora_A), tuple(self.lora_B), layout
            )
            return y.view(*x.shape[:-1], y.shape[-1])
        base_out = self.base(x)
        layout = self.batch.require(x2.shape[0], self.name)
        out2 = base_out.reshape(-1, base_out.shape[-1])
        if use_triton:
            a_cat, b_cat = self._packed_factors(x.dtype)
            y = multi_lora_linear(x2, out2, a_cat, b_cat, layout)
        else:
            a_list = [a.to(x.dtype) for a in self.lora_A]
            b_list = [b.to(x.dtype) for b in self.lora_B]
            y = multi_lora_linear_reference(x2, out2, a_list, b_list, layout)
        return y.view(base_out.shape)

    def _packed_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_cat [sum r, in], B_cat [out, sum r]) in `dtype` (`cat_factors`)."""
        return cat_factors(tuple(self.lora_A), tuple(self.lora_B), dtype)

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
