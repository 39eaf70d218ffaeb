"""The zoo's optimizers: AdamW over everything (the dense path), or, when embedding tables
take sparse gradients (`sparse_embeddings=True`), AdamW over the dense part and a row-wise
Adagrad over the tables, as production trainers run recommendation models (TorchRec's
fused table-batched embeddings).

Row-wise Adagrad keeps one accumulator per table row: `state[r] += mean(g_r ** 2)` over the
row's D values, then `w_r -= lr * g_r / (sqrt(state[r]) + eps)`. Only the rows a batch
looked up change; a row looked up several times in a batch is updated once, with the sum of
its gradients (duplicates summed first, as a coalesced gradient would give, but without
`coalesce()`: see `loka.zoo.rowwise_adagrad`). The optimizer state is thus 4 bytes per
row instead of AdamW's 8 bytes per value, and no step touches the rest of the table.

The update runs in `step()`, outside any compiled region: `torch.compile(model)` still
compiles the whole forward and backward (embedding bags with `sparse=True` included). On
CUDA it is a sort of the lookups and two Triton kernels (`loka.zoo.rowwise_adagrad`; no
host sync), elsewhere a few torch ops. `dedupe="coalesce"` keeps the first version
(`grad.coalesce()`, then one kernel over the distinct rows) for comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from loka.zoo.rowwise_adagrad import rowwise_adagrad_, rowwise_adagrad_sparse_

DENSE_EMBEDDINGS = "dense-adamw"
SPARSE_EMBEDDINGS = "sparse-rowwise-adagrad"
# The option: the row-wise update applied in the lookup's backward (OptimizerConfig.fused_tables).
FUSED_EMBEDDINGS = "fused-rowwise-adagrad"
# How RowWiseAdagrad sums a row's duplicate lookups: "sort" (sort the lookups, segment-sum
# them in the update's kernels) or "coalesce" (`grad.coalesce()` first, the first version).
DEDUPES = ("sort", "coalesce")


class OptimizerLike(Protocol):
    """What the training loop needs of an optimizer."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


@dataclass(frozen=True)
class OptimizerConfig:
    """`lr`, `weight_decay`: AdamW on the dense parameters (the tables too on the dense
    path); `embedding_lr`, `embedding_eps`, `embedding_dedupe` (one of `DEDUPES`): row-wise
    Adagrad on sparse tables; `fused`: the fused AdamW kernel (None: on CUDA, where it is
    several times faster than foreach); `fused_tables`: the option to update the tables of
    `FeatureEmbeddings` in the lookup's backward instead of in `step()` (see
    `FeatureEmbeddings.fuse_rowwise_adagrad`; off by default)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    embedding_lr: float = 0.05
    embedding_eps: float = 1e-8
    fused: bool | None = None
    embedding_dedupe: str = "sort"
    fused_tables: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "embedding_lr", "embedding_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay}")
        if self.embedding_dedupe not in DEDUPES:
            raise ValueError(
                f"embedding_dedupe must be one of {DEDUPES}, got {self.embedding_dedupe!r}"
            )


def sparse_embedding_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the model's `nn.Embedding`/`nn.EmbeddingBag` with `sparse=True`."""
    return [weight for weight, _ in sparse_tables(model)]


def sparse_tables(model: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """`(weight, padding_row)` of each sparse `nn.Embedding`/`nn.EmbeddingBag`: the row the
    optimizer must leave alone because its gradient still holds padding lookups (a module's
    `padding_row` attribute, set where `padding_idx` is left out to keep the backward from
    syncing: `FeatureEmbeddings`), else -1 (none, or `padding_idx` already masks them)."""
    found: dict[int, tuple[nn.Parameter, int]] = {}
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            row = getattr(module, "padding_row", None) if module.padding_idx is None else None
            found.setdefault(id(module.weight), (module.weight, -1 if row is None else int(row)))
    return list(found.values())


def embedding_update(model: nn.Module) -> str:
    """How the model's tables are updated: `"sparse-rowwise-adagrad"`,
    `"fused-rowwise-adagrad"` (in the lookup's backward) or `"dense-adamw"` (the name
    benchmark rows carry)."""
    if any(getattr(module, "fused", False) is True for module in model.modules()):
        return FUSED_EMBEDDINGS
    return SPARSE_EMBEDDINGS if sparse_embedding_weights(model) else DENSE_EMBEDDINGS


def _check_sparse(grad: torch.Tensor) -> None:
    if not grad.is_sparse:
        raise ValueError(
            "row-wise Adagrad needs sparse table gradients: build the model with "
            "sparse_embeddings=True (nn.Embedding/nn.EmbeddingBag with sparse=True)"
        )


def coalesce_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows [U], summed gradients [U, D])` of a sparse table gradient; duplicates summed."""
    _check_sparse(grad)
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


def lookup_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows [N], gradients [N, D])` of a sparse table gradient as it is: one entry per
    lookup, duplicates not summed (no `coalesce()`)."""
    _check_sparse(grad)
    return grad._indices()[0], grad._values()


def _evaluate(closure: Callable[[], Any] | None) -> Any:
    """A step's optional closure (it recomputes the loss), run with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for embedding tables with sparse gradients: one float32 accumulator
    per row, only looked-up rows change, a row's duplicate lookups summed first.

    `dedupe="sort"` (the default) takes the gradient uncoalesced and sums duplicates in the
    update (`rowwise_adagrad_sparse_`); `"coalesce"` calls `grad.coalesce()` first and
    updates the distinct rows (`rowwise_adagrad_`). Both give the same update up to the
    order of float32 sums.

    A param group's `padding_row` (default -1: none) names a row whose lookups the gradient
    still holds but that must never change: the padding row of a sparse table built without
    `padding_idx` (`make_optimizer` sets it from `sparse_tables`)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 0.05,
        eps: float = 1e-8,
        initial_accumulator_value: float = 0.0,
        dedupe: str = "sort",
    ) -> None:
        if not lr > 0 or not eps > 0 or initial_accumulator_value < 0:
            raise ValueError(
                f"need lr > 0, eps > 0, initial_accumulator_value >= 0; got {lr}, {eps}, "
                f"{initial_accumulator_value}"
            )
        if dedupe not in DEDUPES:
            raise ValueError(f"dedupe must be one of {DEDUPES}, got {dedupe!r}")
        defaults = dict(
            lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value, dedupe=dedupe
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.dim() != 2:
                    raise ValueError(
                        f"row-wise Adagrad updates 2-D tables, got {tuple(weight.shape)}"
                    )

    def accumulator(self, weight: torch.Tensor) -> torch.Tensor:
        """The float32 accumulator of `weight`'s rows (made on first use)."""
        group = next(g for g in self.param_groups if any(p is weight for p in g["params"]))
        state = self.state[weight]
        if "sum" not in state:
            state["sum"] = torch.full(
                (weight.size(0),), float(group["initial_accumulator_value"]),
                dtype=torch.float32, device=weight.device,
            )  # fmt: skip
        return state["sum"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but accumulators that exist already are refilled in place, so a table
        updated in its lookup's backward (which holds its accumulator) sees the loaded one."""
        held = {id(w): s["sum"] for w, s in self.state.items() if "sum" in s}
        super().load_state_dict(state_dict)
        for weight, state in self.state.items():
            if id(weight) in held and "sum" in state:
                held[id(weight)].copy_(state["sum"])
                state["sum"] = held[id(weight)]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _evaluate(closure)
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is None:  # also the tables updated in their backward
                    continue
                state = {"sum": self.accumulator(weight)}
                lr, eps = group["lr"], group["eps"]
                padding = int(group.get("padding_row", -1))
                _check_sparse(weight.grad)
                # A coalesced gradient (e.g. one set by hand) has its rows distinct already.
                if group.get("dedupe", "sort") == "coalesce" or weight.grad.is_coalesced():
                    rows, grads = coalesce_rows(weight.grad)
                    if padding >= 0:  # a boolean select: syncs, as coalesce does already
                        keep = rows != padding
                        rows, grads = rows[keep], grads[keep]
                    rowwise_adagrad_(weight, state["sum"], rows, grads, lr=lr, eps=eps)
                else:
                    rows, grads = lookup_rows(weight.grad)
                    rowwise_adagrad_sparse_(weight, state["sum"], rows, grads, lr=lr, eps=eps,
                                            skip_row=padding)  # fmt: skip
        return loss


class HybridOptimizer:
    """AdamW on the dense parameters and row-wise Adagrad on sparse tables, stepped as one
    optimizer (`step`, `zero_grad`, `state_dict`, `load_state_dict`, `param_groups`)."""

    def __init__(self, dense: torch.optim.Optimizer, sparse: RowWiseAdagrad) -> None:
        self.dense, self.sparse = dense, sparse

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, RowWiseAdagrad]:
        return self.dense, self.sparse

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.dense.param_groups, *self.sparse.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {**self.dense.state, **self.sparse.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _evaluate(closure)
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"dense": self.dense.state_dict(), "sparse": self.sparse.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dense.load_state_dict(state_dict["dense"])
        self.sparse.load_state_dict(state_dict["sparse"])


def make_optimizer(
    model: nn.Module, config: OptimizerConfig | None = None
) -> torch.optim.AdamW | HybridOptimizer:
    """The optimizer the zoo trains `model` with: AdamW over every parameter when no table
    has sparse gradients, else a `HybridOptimizer` (AdamW on the dense parameters, row-wise
    Adagrad on the sparse tables). `embedding_update(model)` names which."""
    config = OptimizerConfig() if config is None else config
    found = sparse_tables(model)
    tables = [weight for weight, _ in found]
    padding_rows = sorted({row for _, row in found})
    groups = [
        {"params": [w for w, r in found if r == row], "padding_row": row} for row in padding_rows
    ]
    sparse = None
    if tables:
        sparse = RowWiseAdagrad(
            groups,
            lr=config.embedding_lr,
            eps=config.embedding_eps,
            dedupe=config.embedding_dedupe,
        )
    if config.fused_tables:
        bags = [m for m in model.modules() if hasattr(m, "fuse_rowwise_adagrad")]
        if sparse is None or not bags:
            raise ValueError(
                "fused_tables needs FeatureEmbeddings with sparse tables (sparse_embeddings=True)"
            )
        for module in bags:
            weight = module.bags.weight
            group = next(g for g in sparse.param_groups if any(p is weight for p in g["params"]))
            module.fuse_rowwise_adagrad(sparse.accumulator(weight), group)
    in_tables = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in in_tables]
    fused = config.fused
    if fused is None:
        fused = any(p.is_cuda for p in dense)
    adamw = torch.optim.AdamW(dense, lr=config.lr, weight_decay=config.weight_decay, fused=fused)
    return adamw if sparse is None else HybridOptimizer(adamw, sparse)
