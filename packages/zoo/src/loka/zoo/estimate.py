"""What a training step of a preset costs, estimated without a GPU: FLOPs and time of the
`nn.Linear` GEMMs against everything else, and the memory the step needs.

`estimate_step("dhen", "xl")` builds the model on the meta device (no memory, no compute),
runs one bf16 forward, loss and backward on a meta batch of the preset's shapes, and counts
every aten op:
- GEMMs (`mm`, `addmm`, `bmm`, `baddbmm`): FLOPs, and whether they belong to an `nn.Linear`
  (forward: inside its call; backward: on an autograd node its call created) or not
  (attention, interactions, scoring);
- every other op: the bytes it reads and writes, as run eagerly (unfused), and one FLOP per
  element it writes;
- embedding lookups and their update, from the lookups and the table sizes: the dense path
  (a dense table gradient and AdamW over every row) or the sparse one (row-wise Adagrad
  over the looked-up rows);
- the dense optimizer (fused AdamW) and autocast's weight casts, per parameter.

Time is a roofline on the device (`H200`): a GEMM takes the longer of its FLOPs at
`gemm_efficiency` of the bf16 peak and its operand bytes at `memory_efficiency` of the HBM
bandwidth; every other op its bytes at that bandwidth. Unfused bytes overstate what
`torch.compile` leaves (it fuses chains of elementwise ops), so the estimated linear time
share is a lower bound of the compiled step's, as far as the efficiencies hold.

Memory: fp32 weights, gradients and optimizer state, FP8 copies of the linear weights (a
weight and its transpose, 2 bytes per value), the activations autograd saves for backward
(bf16; a saved tensor is counted once however many ops save it) with autocast's bf16 weight
copies, and the sparse path's transient row gradients. Everything that allocates outside
these (workspaces, the caching allocator's slack) is left to `memory_headroom`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from loka.zoo.data.behaviour import SyntheticBehaviourConfig
from loka.zoo.data.criteo import SyntheticCriteoConfig
from loka.zoo.optim import SPARSE_EMBEDDINGS, embedding_update
from loka.zoo.registry import SPECS, SequenceDataConfig, preset_config
from loka.zoo.tasks import click_loss, next_item_loss

aten = torch.ops.aten
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_FREE = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided, aten.new_empty_strided}
_LINEAR = "loka_zoo_linear"  # autograd-node metadata key: the node belongs to an nn.Linear
_BOUNDARY = "loka_zoo_linear_input"  # ... the node made a Linear's input (not its own)
_ADAMW_BYTES = 28  # fused AdamW per fp32 value: reads weight, grad, 2 moments; writes 3
_CAST_BYTES = 12  # autocast per linear weight: fp32 -> bf16 forward, bf16 -> fp32 gradient
# Compiled, elementwise ops fuse into the kernels around the GEMMs; what stays in memory is
# roughly each saved activation written (forward) and read (backward), and a gradient of the
# same size written and read: 4 passes over the saved activations.
_FUSED_PASSES = 4


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes
    gemm_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    memory_headroom: float = 0.8  # share of memory the estimate may fill


H200 = Device("H200", bf16_flops=989e12, memory_bandwidth=4.8e12, memory=141e9)


@dataclass(frozen=True)
class StepEstimate:
    """One training step of a preset (bf16 autocast, `make_optimizer`'s optimizer)."""

    name: str
    preset: str
    batch_size: int
    embedding_update: str
    device: Device
    linear_flops: int  # forward, dgrad and wgrad of every nn.Linear
    other_matmul_flops: int  # GEMMs outside nn.Linear: attention, interactions, scoring
    other_flops: int  # one per element written by every other op
    linear_seconds: float
    other_matmul_seconds: float
    elementwise_seconds: float  # everything else of forward and backward, unfused (eager)
    fused_elementwise_seconds: float  # the same as torch.compile would leave it (crude model)
    embedding_seconds: float  # lookups, their gradient and the table update
    optimizer_seconds: float  # dense AdamW and autocast's weight casts
    dense_params: int
    linear_params: int
    embedding_params: int
    embedding_rows: int
    state_bytes: int  # fp32 weights, gradients and optimizer state
    fp8_bytes: int  # FP8 copies of the linear weights (and their transposes)
    activation_bytes: int  # saved for backward, with autocast's bf16 weight copies
    transient_bytes: int  # the sparse path's row gradients

    @property
    def total_flops(self) -> int:
        return self.linear_flops + self.other_matmul_flops + self.other_flops

    @property
    def linear_flop_share(self) -> float:
        return self.linear_flops / self.total_flops

    def _step_seconds(self, elementwise: float) -> float:
        return (
            self.linear_seconds + self.other_matmul_seconds + elementwise
            + self.embedding_seconds + self.optimizer_seconds
        )  # fmt: skip

    @property
    def step_seconds(self) -> float:
        """The compiled step: elementwise work fused (see the module)."""
        return self._step_seconds(self.fused_elementwise_seconds)

    @property
    def linear_time_share(self) -> float:
        """The linears' share of the compiled step's estimated time."""
        return self.linear_seconds / self.step_seconds

    @property
    def linear_time_share_unfused(self) -> float:
        """The linears' share with every elementwise op unfused, as in eager mode: a lower
        bound of the compiled step's share."""
        return self.linear_seconds / self._step_seconds(self.elementwise_seconds)

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.fp8_bytes + self.activation_bytes + self.transient_bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.device.memory * self.device.memory_headroom

    def summary(self) -> dict[str, Any]:
        """The numbers a report or benchmark row needs, rounded for reading."""
        return {
            "model": self.name,
            "preset": self.preset,
            "batch_size": self.batch_size,
            "embedding_update": self.embedding_update,
            "dense_params_M": round(self.dense_params / 1e6, 1),
            "embedding_params_M": round(self.embedding_params / 1e6, 1),
            "linear_tflop": round(self.linear_flops / 1e12, 2),
            "linear_flop_share": round(self.linear_flop_share, 3),
            "linear_time_share": round(self.linear_time_share, 3),
            "linear_time_share_unfused": round(self.linear_time_share_unfused, 3),
            "step_ms": round(self.step_seconds * 1e3, 1),
            "memory_gb": round(self.memory_bytes / 1e9, 1),
            "activation_gb": round(self.activation_bytes / 1e9, 1),
            "state_gb": round(self.state_bytes / 1e9, 1),
            "fp8_gb": round(self.fp8_bytes / 1e9, 1),
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _matmul_flops(func: Any, args: tuple) -> int:
    a, b = (args[1], args[2]) if func in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    batch = a.size(0) if a.dim() == 3 else 1
    return 2 * batch * a.size(-2) * a.size(-1) * b.size(-1)


class _FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as the GPU runs it (a fused kernel: the score matrix
    never reaches memory), costed from its operands; on the meta device nothing runs."""

    @staticmethod
    def forward(ctx, counter, q, k, v, mask, causal):  # type: ignore[override]
        ctx.counter, ctx.work = counter, 0.5 if causal else 1.0  # causal kernels skip half
        out = q.new_empty(*q.shape[:-1], v.size(-1))
        extra = [mask] if mask is not None else []
        counter.attention(q, k, v, [q, k, v, *extra], [out], passes=2 * ctx.work)
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q, k, v)]
        # Recompute the scores, then dV, dP, dQ, dK: five GEMMs of the forward's two's size.
        ctx.counter.attention(q, k, v, [q, k, v, out, grad], grads, passes=5 * ctx.work)
        return None, *grads, None, None


class _AttentionAsFused(TorchFunctionMode):
    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        # Dropout and the scale happen inside the fused kernel: they cost nothing apart.
        if set(kwargs) - {"attn_mask", "is_causal", "dropout_p", "scale"} or len(args) > 3:
            raise NotImplementedError(
                "estimate: scaled_dot_product_attention(q, k, v) takes only keyword options"
            )
        return _FusedAttention.apply(
            self.counter, q, k, v, kwargs.get("attn_mask"), bool(kwargs.get("is_causal"))
        )


class _Counter(TorchDispatchMode):
    """Tallies FLOPs and bytes per op; `linear_depth` > 0 while an nn.Linear runs forward."""

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device = device
        self.linear_depth = 0
        self.flops = {"linear": 0, "matmul": 0, "other": 0}
        self.seconds = {"linear": 0.0, "matmul": 0.0, "other": 0.0}

    def _seconds(self, moved: int, flops: int = 0) -> float:
        bandwidth = self.device.memory_bandwidth * self.device.memory_efficiency
        return max(
            moved / bandwidth, flops / (self.device.bf16_flops * self.device.gemm_efficiency)
        )

    def attention(self, q, k, v, inputs: list, outputs: list, passes: float) -> None:
        """`passes` GEMMs of `q k^T`'s size, reading `inputs` and writing `outputs` once."""
        flops = round(passes * 2 * q.size(-2) * k.size(-2) * q.size(-1) * math.prod(q.shape[:-2]))
        moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
        self.flops["matmul"] += flops
        self.seconds["matmul"] += self._seconds(moved, flops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if func.is_view or packet in _FREE or "embedding" in packet.__name__:
            return out  # views and allocations are free; embeddings are costed from lookups
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        storages = {t.untyped_storage()._cdata for t in inputs}
        if not func._schema.is_mutable and all(
            o.untyped_storage()._cdata in storages for o in outputs
        ):
            return out  # an alias under another name (detach, _unsafe_view, ...)
        moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, outputs))
        if packet in _MATMULS:
            node = torch._C._current_autograd_node()
            linear = self.linear_depth > 0 if node is None else _LINEAR in node.metadata
            kind = "linear" if linear else "matmul"
            flops = _matmul_flops(packet, args)
            self.flops[kind] += flops
            self.seconds[kind] += self._seconds(moved, flops)
        else:
            self.flops["other"] += sum(o.numel() for o in outputs)
            self.seconds["other"] += self._seconds(moved)
        return out


def _grad_fns(tensors: tuple) -> list[Any]:
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _mark_linear_nodes(inputs: tuple, output: torch.Tensor) -> None:
    """Tag the autograd nodes a Linear call created (between its output and the inputs'
    nodes, which `_enter` tagged as the boundary), so its backward GEMMs count as its own.
    Node wrappers are not stable Python objects: tags live in their `metadata`."""
    pending = [output.grad_fn] if output.grad_fn is not None else []
    while pending:
        node = pending.pop()
        meta = node.metadata
        if _LINEAR in meta or _BOUNDARY in meta or type(node).__name__ == "AccumulateGrad":
            continue
        meta[_LINEAR] = True
        pending.extend(n for n, _ in node.next_functions if n is not None)
    for node in _grad_fns(inputs):
        node.metadata.pop(_BOUNDARY, None)


def _meta_batch(config: Any, data: Any, batch: int) -> dict[str, torch.Tensor]:
    def ids(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int64, device="meta")

    if isinstance(data, SyntheticCriteoConfig):
        out = {
            "dense": torch.zeros(batch, config.num_dense, dtype=torch.bfloat16, device="meta"),
            "sparse": ids(batch, config.num_sparse, data.max_bag_size),
            "label": torch.zeros(batch, device="meta"),
        }
        if isinstance(data, SyntheticBehaviourConfig):
            out["sequence"] = ids(batch, config.max_seq_len)
        return out
    assert isinstance(data, SequenceDataConfig)
    length = config.max_seq_len
    out = {"negatives": ids(data.num_negatives)}
    if data.layout == "padded":
        return {**out, "items": ids(batch, length), "targets": ids(batch, length)}
    # Synthetic lengths are uniform in [3, L + 1]; a sequence of n items gives n - 1 pairs.
    tokens = round(batch * ((3 + length + 1) / 2 - 1))
    return {**out, "items": ids(tokens), "targets": ids(tokens), "offsets": ids(batch + 1)}


def _embedding_costs(
    model: nn.Module, lookups: dict[int, int], sparse: bool, device: Device
) -> tuple[float, int]:
    """(seconds, transient bytes) of the tables: lookups, gradient, update."""
    moved, transient = 0, 0
    for module in model.modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or id(module) not in lookups:
            continue
        rows, dim = module.weight.shape
        looked_up = lookups[id(module)] * dim * 4  # fp32 rows
        moved += 2 * looked_up  # gather, and write the (pooled) output at most as much
        if sparse:
            # Row gradients written, gathered in sorted order and summed per row (partials
            # written and read), then the update reads and writes the rows and accumulators.
            moved += 6 * looked_up
            transient += 2 * looked_up
        else:
            # A dense gradient: zeroed, scattered into, then AdamW over every row.
            moved += 2 * rows * dim * 4 + looked_up + rows * dim * _ADAMW_BYTES
    return moved / (device.memory_bandwidth * device.memory_efficiency), transient


def estimate_step(
    name: str,
    preset: str = "xl",
    *,
    batch_size: int | None = None,
    device: Device = H200,
    **overrides: Any,
) -> StepEstimate:
    """Estimate one bf16 training step of `create(name, preset, batch_size=..., **overrides)`
    on `device`, building the model on the meta device only (see the module)."""
    config, data, batch = preset_config(name, preset, batch_size=batch_size, **overrides)
    spec = SPECS[name]
    with torch.device("meta"):
        model = spec.model(config)
    update = embedding_update(model)
    sparse = update == SPARSE_EMBEDDINGS
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    table_ids = {id(m.weight) for m in tables}
    table_modules = {id(m) for m in tables}
    for table in tables:
        table.sparse = False  # the meta device has no sparse backward; costed from lookups
    params = list(model.parameters())
    dense = [p for p in params if id(p) not in table_ids]
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    model = model.to(torch.bfloat16)  # bf16 activations, as autocast runs the linears

    counter = _Counter(device)
    lookups: dict[int, int] = {}
    hooks = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(lambda m, i: _enter(counter, i)))
            hooks.append(module.register_forward_hook(lambda m, i, o: _leave(counter, i, o)))
        elif id(module) in table_modules:
            hooks.append(module.register_forward_pre_hook(
                lambda m, i: lookups.__setitem__(id(m), lookups.get(id(m), 0) + i[0].numel())
            ))  # fmt: skip
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages:
            saved[key] = t.untyped_storage().nbytes()
        return t

    loss_fn = click_loss if isinstance(data, SyntheticCriteoConfig) else next_item_loss
    batch_tensors = _meta_batch(config, data, batch)
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            counter,
            _AttentionAsFused(counter),
        ):
            loss_fn(model, batch_tensors).backward()
    finally:
        for hook in hooks:
            hook.remove()

    embedding_seconds, transient = _embedding_costs(model, lookups, sparse, device)
    dense_values = sum(p.numel() for p in dense)
    table_values = sum(m.weight.numel() for m in tables)
    table_rows = sum(m.weight.size(0) for m in tables)
    # fp32 weight, gradient and two AdamW moments; sparse tables: weight and a row accumulator.
    table_state = table_values * 4 + table_rows * 4 if sparse else table_values * 16
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    activations = sum(saved.values())
    return StepEstimate(
        name=name,
        preset=preset,
        batch_size=batch,
        embedding_update=update,
        device=device,
        linear_flops=counter.flops["linear"],
        other_matmul_flops=counter.flops["matmul"],
        other_flops=counter.flops["other"],
        linear_seconds=counter.seconds["linear"],
        other_matmul_seconds=counter.seconds["matmul"],
        elementwise_seconds=counter.seconds["other"],
        fused_elementwise_seconds=min(
            counter.seconds["other"], _FUSED_PASSES * activations / bandwidth
        ),
        embedding_seconds=embedding_seconds,
        optimizer_seconds=(dense_values * _ADAMW_BYTES + linear_params * _CAST_BYTES) / bandwidth,
        dense_params=dense_values,
        linear_params=linear_params,
        embedding_params=table_values,
        embedding_rows=table_rows,
        state_bytes=dense_values * 16 + table_state,
        fp8_bytes=2 * linear_params,
        activation_bytes=activations + 2 * linear_params,
        transient_bytes=transient,
    )


def _enter(counter: _Counter, inputs: tuple) -> None:
    counter.linear_depth += 1
    for node in _grad_fns(inputs):
        node.metadata[_BOUNDARY] = True


def _leave(counter: _Counter, inputs: tuple, output: torch.Tensor) -> None:
    counter.linear_depth -= 1
    _mark_linear_nodes(inputs, output)


def format_estimates(estimates: list[StepEstimate]) -> str:
    """A markdown table of estimates (the zoo README's xl table)."""
    rows = [e.summary() for e in estimates]
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


__all__ = ["H200", "Device", "StepEstimate", "estimate_step", "format_estimates"]
