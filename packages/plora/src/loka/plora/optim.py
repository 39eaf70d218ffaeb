"""One optimizer per adapter: each job keeps its own state, learning rate and clipping."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loka.plora.model import PackedLora


@dataclass(frozen=True)
class AdapterStep:
    """What one optimizer step did to one adapter."""

    index: int
    grad_norm: float  # before clipping; NaN/Inf when the gradient was not finite
    stepped: bool
    reason: str = ""


class PerAdapterOptimizer:
    """AdamW per adapter with the job's lr, betas, weight decay and gradient-norm clip.

    The packed forward and backward are shared, but the gradients of different adapters
    never mix, so clipping and stepping per adapter gives each job exactly the update it
    would get alone. An adapter whose gradient is not finite is not stepped (its state
    is untouched) and is reported; the others step normally.
    """

    def __init__(self, packed: PackedLora) -> None:
        self.packed = packed
        self.params = [packed.adapter_parameters(i) for i in range(packed.num_adapters)]
        fused = packed.device.type == "cuda"
        self.optimizers = [
            torch.optim.AdamW(
                params,
                lr=job.lr,
                betas=(job.beta1, job.beta2),
                weight_decay=job.weight_decay,
                fused=fused,
                foreach=None if fused else True,
            )
            for job, params in zip(packed.jobs, self.params, strict=True)
        ]

    def step(self, active: Sequence[int] | None = None) -> list[AdapterStep]:
        """Clip and step the `active` adapters (default: all); clears every gradient."""
        indices = list(range(self.packed.num_adapters)) if active is None else list(active)
        for i in indices:
            self.packed.check_index(i)
        norms = []
        for i in indices:
            grads = [p.grad for p in self.params[i] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else None
            norms.append(norm)
        present = [n for n in norms if n is not None]
        host = torch.stack(present).float().cpu().tolist() if present else []  # one sync
        reports, k = [], 0
        for i, norm in zip(indices, norms, strict=True):
            if norm is None:
                reports.append(AdapterStep(i, 0.0, False, "no gradient (adapter had no tokens)"))
                continue
            value = host[k]
            k += 1
            if not math.isfinite(value):
                reports.append(AdapterStep(i, value, False, "non-finite gradient; step skipped"))
                continue
            job = self.packed.jobs[i]
            if job.max_grad_norm is not None:
                grads = [p.grad for p in self.params[i] if p.grad is not None]
                torch.nn.utils.clip_grads_with_norm_(grads, job.max_grad_norm, norm)
            self.optimizers[i].step()
            reports.append(AdapterStep(i, value, True))
        self.zero_grad()
        return reports

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self, index: int) -> dict:
        self.packed.check_index(index)
        return self.optimizers[index].state_dict()

    def load_state_dict(self, index: int, state: dict) -> None:
        self.packed.check_index(index)
        self.optimizers[index].load_state_dict(state)
