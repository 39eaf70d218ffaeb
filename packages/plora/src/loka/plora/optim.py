"""One optimizer per adapter: each job keeps its own state, learning rate and clipping."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loka.plora.model import PackedLora

MAX_STEP_GRAPHS = 4  # captured optimizer steps kept (one per active set of jobs, LRU)
_SEEN = 16  # step layouts remembered (seen once, not captured)


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

    `graphs` (default: on CUDA): the step's device work (every job's gradient norm, clip
    and fused AdamW update) replays a CUDA graph, captured the second time a set of active
    jobs steps over the same gradient tensors. Issued op by op, 32 jobs' steps took ~160 ms
    of host time a step (`bench/plora.py` profile), with the GPU idle behind it once the
    backward drained: the packed step was host-bound. The graph reads the packed gradients,
    parameters and moments where they are (the gradients are zeroed in place, never
    re-made), so nothing is copied in; a changed gradient tensor or parameter storage,
    another active set, a changed lr, betas, eps or weight decay (a scheduler) or
    `load_state_dict` makes another graph. `capture` replaces the CUDA capture (tests).
    """

    def __init__(
        self,
        packed: PackedLora,
        graphs: bool | None = None,
        capture: Callable[[Callable[[], torch.Tensor]], tuple[object, torch.Tensor]] | None = None,
    ) -> None:
        self.packed = packed
        device = packed.device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self._capture = capture or _cuda_capture
        self._step_graphs: OrderedDict[tuple, tuple[object, torch.Tensor]] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self.graph_stats = {"replays": 0, "captures": 0, "eager": 0}
        self.params = [packed.adapter_parameters(i) for i in range(packed.num_adapters)]
        # Fused on every device (torch has fused AdamW for the CPU too): its `found_inf`
        # skips a job's update on the device, so no step waits for the gradient norms.
        self.optimizers = [
            torch.optim.AdamW(
                params,
                lr=job.lr,
                betas=(job.beta1, job.beta2),
                weight_decay=job.weight_decay,
                fused=True,
            )
            for job, params in zip(packed.jobs, self.params, strict=True)
        ]

    def step(self, active: Sequence[int] | None = None) -> list[AdapterStep]:
        """Clip and step the `active` adapters (default: all); clears every gradient.

        Every update is queued before anything is read back: a job whose gradient norm is
        not finite is skipped by its fused AdamW (`found_inf`, decided on the device; its
        parameters, moments and step count stay as they were), and the norms come to the
        host in one copy at the end, for the report. Waiting for them before stepping (as
        this did) left the GPU idle while the host issued 32 jobs' optimizer steps."""
        indices = list(range(self.packed.num_adapters)) if active is None else list(active)
        for i in indices:
            self.packed.check_index(i)
        self.packed.sync_adapter_parameters()
        grads = {i: [p.grad for p in self.params[i] if p.grad is not None] for i in indices}
        present = [i for i in indices if grads[i]]
        host: dict[int, float] = {}
        if present:
            norms = self._queue_steps(present, grads)
            host = dict(zip(present, norms.cpu().tolist(), strict=True))  # the one sync
        reports = []
        for i in indices:
            if i not in host:
                reports.append(AdapterStep(i, 0.0, False, "no gradient (adapter had no tokens)"))
            elif not math.isfinite(host[i]):
                reports.append(AdapterStep(i, host[i], False, "non-finite gradient; step skipped"))
            else:
                reports.append(AdapterStep(i, host[i], True))
        self.zero_grad()
        return reports

    def _queue_steps(self, present: list[int], grads: dict[int, list[torch.Tensor]]):
        """Queue the `present` jobs' norms, clips and updates; their gradient norms (device).
        From a CUDA graph where one is captured for these jobs and gradient tensors (see the
        class docstring), else op by op (the first time, so the optimizer states exist
        before a capture)."""
        run = lambda: self._step_ops(present, grads)  # noqa: E731
        first = grads[present[0]][0]
        if not self.graphs or (first.is_cuda and torch.cuda.is_current_stream_capturing()):
            return run()
        # Where the gradients (hand-set ones too) and the packed parameters are: a graph
        # reads and writes those addresses (a `.to()` moves the parameters).
        packed_params = [t for m in self.packed.modules.values()
                         for t in (m.lora_packed_A, m.lora_packed_Bt)]  # fmt: skip
        # The hyperparameters are baked into a captured step: a changed lr (a scheduler)
        # must not replay an old one.
        hyper = tuple((g["lr"], g["betas"], g["eps"], g["weight_decay"])
                      for i in present for g in self.optimizers[i].param_groups)  # fmt: skip
        key = (
            tuple(present),
            tuple(g.data_ptr() for i in present for g in grads[i]),
            tuple(t.data_ptr() for t in packed_params),
            hyper,
        )
        found = self._step_graphs.get(key)
        if found is not None:
            self._step_graphs.move_to_end(key)
            graph, norms = found
            graph.replay()
            self.graph_stats["replays"] += 1
            return norms
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > _SEEN:  # gradients made anew each step never settle
                self._seen.popitem(last=False)
            self.graph_stats["eager"] += 1
            return run()
        groups = [g for i in present for g in self.optimizers[i].param_groups]
        for group in groups:  # torch refuses a capture of step() unless capturable is set
            group["capturable"] = True  # (the fused step runs the same kernels either way)
        try:
            graph, norms = self._capture(run)
        finally:
            for group in groups:
                group["capturable"] = False
        if len(self._step_graphs) >= MAX_STEP_GRAPHS:
            self._step_graphs.popitem(last=False)
        self._step_graphs[key] = (graph, norms)
        self.graph_stats["captures"] += 1
        graph.replay()  # the capture ran nothing: this step's update
        return norms

    def _step_ops(self, present: list[int], grads: dict[int, list[torch.Tensor]]):
        norms = torch.stack([torch.nn.utils.get_total_norm(grads[i]) for i in present]).float()
        skip = (~torch.isfinite(norms)).float()
        for k, i in enumerate(present):
            job = self.packed.jobs[i]
            if job.max_grad_norm is not None:
                # A non-finite norm makes the clipped gradient non-finite too: the update
                # it would feed is skipped below.
                torch.nn.utils.clip_grads_with_norm_(grads[i], job.max_grad_norm, norms[k])
            optimizer = self.optimizers[i]
            optimizer.found_inf = skip[k]
            optimizer.step()
        return norms

    def release_graphs(self) -> None:
        """Drop the captured steps (and the memory they hold); later steps capture anew."""
        self._step_graphs.clear()
        self._seen.clear()

    def zero_grad(self) -> None:
        """Zeroes the packed gradients in place (a few launches for every adapter; the
        aliases stay bound to them, so the next backward accumulates where they point)."""
        grads = self.packed.packed_gradients()
        if grads:
            torch._foreach_zero_(grads)

    def state_dict(self, index: int) -> dict:
        self.packed.check_index(index)
        return self.optimizers[index].state_dict()

    def load_state_dict(self, index: int, state: dict) -> None:
        self.packed.check_index(index)
        optimizer = self.optimizers[index]
        optimizer.load_state_dict(orient_adapter_state(state, self.params[index]))
        self.release_graphs()  # captured steps read the replaced state tensors
        # A state saved by a foreach AdamW (this class before it fused everywhere) brings
        # its group flags along; the device-side skip needs the fused step.
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, None


def _cuda_capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, output) of `fn()` captured on a side stream; nothing runs until a replay."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # thread_local: another thread's CUDA calls (a data loader's pinned copies) do not
    # invalidate the capture.
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def orient_adapter_state(state: dict, params: Sequence[torch.Tensor]) -> dict:
    """`state` (an AdamW state dict of one adapter) with each moment shaped like its
    parameter: a state saved when B's parameters were `[out, r]` (before the packed `B^T`
    layout) has its B moments transposed. A state of another number of tensors, or a
    moment that fits its parameter in neither orientation, raises ValueError (AdamW's own
    `load_state_dict` would take it and fail at the next step)."""
    per_param = state.get("state", {})
    if per_param and len(per_param) != len(params):
        raise ValueError(
            f"optimizer state has {len(per_param)} tensors, the adapter has {len(params)}"
        )
    turned = {}
    for slot, entry in per_param.items():
        if not isinstance(slot, int) or not 0 <= slot < len(params):
            raise ValueError(f"optimizer state names parameter {slot!r}, not one of the adapter's")
        shape = tuple(params[slot].shape)
        turned[slot] = {}
        for key, value in entry.items():
            if key.startswith("exp_avg") and isinstance(value, torch.Tensor):
                if value.dim() == 2 and tuple(value.shape) == shape[::-1] != shape:
                    value = value.t().contiguous()
                elif tuple(value.shape) != shape:
                    raise ValueError(
                        f"optimizer state {slot} ({key}) has shape {tuple(value.shape)}, "
                        f"the adapter parameter {shape}"
                    )
            turned[slot][key] = value
    return {**state, "state": turned}
