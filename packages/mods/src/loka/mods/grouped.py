"""Small-GEMM grouping: a module whose job is "apply these G equal-shape linears to these G
inputs" (per-feature projections, per-task heads) becomes `GroupedLinear`, which runs them as
one batched GEMM with the same forward signature and the same Parameters.

How the container hands inputs to its linears and gathers their outputs is read from a
sample batch (`detect_group_layout`): inputs stacked along a dim, a list, or one input shared
by all; outputs stacked along a dim, a list, or concatenated. Backends:

- ``"bmm"`` (default): one ``torch.baddbmm`` over the stacked weights (one ``F.linear`` over
  the concatenated weights when all linears share their input). On the H200 this was 8x a
  loop of 32 ``F.linear`` at 16384x128x128, while a grouped Triton kernel was 0.4x.
- ``"fp8"``: the three passes through `loka.kernels.grouped_mm` with FP8 operands (rowwise,
  dynamic), each operand quantized for all groups in one launch; passes whose recipe is bf16
  use bmm. For where a measured plan says it wins.
- ``"loop"``: the original linears one by one (the baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loka.kernels import registry
from loka.mods.bias_grad import bias_gradient
from loka.mods.config import Fp8LinearConfig
from loka.mods.dtypes import cast
from loka.mods.fp8_linear import compute_dtype
from loka.mods.linear_function import GEMM_OUT_DTYPE
from loka.mods.linear_plan import LinearPlan
from loka.mods.ops import call
from loka.mods.trace import _hooks, run_model

__all__ = [
    "GroupLayout",
    "GroupedLinear",
]

BACKENDS = ("bmm", "fp8", "loop")
INPUT_LAYOUTS = ("stacked", "list", "shared")
OUTPUT_LAYOUTS = ("stacked", "list", "concat")


class GroupingError(ValueError):
    """A container that cannot be grouped (the message says why)."""


@dataclass(frozen=True)
class GroupLayout:
    """How a container feeds its G linears and returns their outputs: ``inputs`` "stacked"
    (group g is ``x.select(input_dim, g)``), "list" (``x[g]``) or "shared" (``x`` for all);
    ``outputs`` "stacked" (along ``output_dim``), "list" or "concat" (along the last dim)."""

    inputs: str = "stacked"
    input_dim: int = 1
    outputs: str = "stacked"
    output_dim: int = 1

    def __post_init__(self) -> None:
        if self.inputs not in INPUT_LAYOUTS:
            raise GroupingError(f"inputs must be one of {INPUT_LAYOUTS}, got {self.inputs!r}")
        if self.outputs not in OUTPUT_LAYOUTS:
            raise GroupingError(f"outputs must be one of {OUTPUT_LAYOUTS}, got {self.outputs!r}")


def group_linears(container: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear descendants of `container` (names relative to it), in module order, if
    they are at least two, all of one shape, and hold every parameter of the container."""
    linears = [(n, m) for n, m in container.named_modules() if type(m) is nn.Linear]
    if len(linears) < 2:
        raise GroupingError(f"holds {len(linears)} nn.Linear, grouping needs at least 2")
    shapes = {(m.in_features, m.out_features, m.bias is not None) for _, m in linears}
    if len(shapes) != 1:
        raise GroupingError(f"its linears differ in shape (in, out, bias): {sorted(shapes)}")
    owned = {id(p) for _, m in linears for p in m.parameters()}
    others = [n for n, p in container.named_parameters() if id(p) not in owned]
    if others:
        raise GroupingError(f"has parameters outside its linears: {others[:4]}")
    return linears


class GroupedLinear(nn.Module):
    """G equal-shape linears run as one grouped GEMM; children and Parameters are the
    container's own (same names, same objects), so its state_dict is unchanged."""

    loka_gemm_kind = "grouped"

    def __init__(
        self,
        container: nn.Module,
        layout: GroupLayout,
        *,
        backend: str = "bmm",
        config: Fp8LinearConfig | None = None,
    ) -> None:
        super().__init__()
        linears = group_linears(container)
        for name, child in container.named_children():
            self.add_module(name, child)
        self.linear_names = tuple(name for name, _ in linears)
        self.layout = layout
        self.set_backend(backend, config)
        self.train(container.training)

    def set_backend(self, backend: str, config: Fp8LinearConfig | None = None) -> None:
        """Switch between "bmm", "fp8" (with its config) and "loop"."""
        if backend not in BACKENDS:
            raise GroupingError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.plan = _fp8_plan(config) if backend == "fp8" else None
        self.backend = backend
        self.fp8_config = config

    @property
    def linears(self) -> list[nn.Linear]:
        return [self.get_submodule(name) for name in self.linear_names]

    def restore(self, container: nn.Module) -> nn.Module:
        """`container` (the module this one replaced) with this module's children put back."""
        for name, child in self.named_children():
            setattr(container, name, child)
        return container

    # --- layout -----------------------------------------------------------------------------

    def _inputs(self, x: Any, G: int) -> tuple[torch.Tensor | list[torch.Tensor], tuple]:
        """(per-group inputs as [G, rows, K] (stacked/list) or one [rows, K] (shared), the
        leading shape of one group's input)."""
        K = self.linears[0].in_features
        if self.layout.inputs == "shared":
            return x.reshape(-1, K), tuple(x.shape[:-1])
        if self.layout.inputs == "list":
            if len(x) != G:
                raise ValueError(f"GroupedLinear: expected {G} inputs, got {len(x)}")
            return torch.stack([t.reshape(-1, K) for t in x]), tuple(x[0].shape[:-1])
        if x.shape[self.layout.input_dim] != G:
            raise ValueError(
                f"GroupedLinear: expected {G} groups along dim {self.layout.input_dim} of the "
                f"input, got shape {tuple(x.shape)}"
            )
        grouped = x.movedim(self.layout.input_dim, 0)
        return grouped.reshape(G, -1, K), tuple(grouped.shape[1:-1])

    def _outputs(self, y: torch.Tensor, lead: tuple) -> Any:
        """[G, rows, N] -> the container's output layout."""
        G, _, N = y.shape
        y = y.reshape(G, *lead, N)
        if self.layout.outputs == "list":
            return list(y.unbind(0))
        if self.layout.outputs == "concat":
            return y.movedim(0, -2).reshape(*lead, G * N)
        return y.movedim(0, self.layout.output_dim)

    # --- forward ----------------------------------------------------------------------------

    def forward(self, x: Any) -> Any:
        linears = self.linears
        G = len(linears)
        if self.backend == "loop":
            return self._loop(x, linears)
        inputs, lead = self._inputs(x, G)
        weight = torch.stack([lin.weight for lin in linears])  # [G, N, K]
        has_bias = linears[0].bias is not None
        bias = torch.stack([lin.bias for lin in linears]) if has_bias else None  # [G, N]
        if self.layout.inputs == "shared" and self.backend == "bmm":
            N = weight.shape[1]
            flat = F.linear(inputs, weight.flatten(0, 1), None if bias is None else bias.flatten())
            return self._outputs(flat.view(-1, G, N).transpose(0, 1), lead)
        if self.layout.inputs == "shared":
            inputs = inputs.unsqueeze(0).expand(G, -1, -1)
        if self.backend == "fp8":
            y = GroupedFp8Function.apply(inputs, weight, bias, self.plan, compute_dtype(inputs))
        else:
            y = _bmm(inputs, weight, bias)
        return self._outputs(y, lead)

    def _loop(self, x: Any, linears: list[nn.Linear]) -> Any:
        if self.layout.inputs == "shared":
            outs = [lin(x) for lin in linears]
        elif self.layout.inputs == "list":
            outs = [lin(t) for lin, t in zip(linears, x, strict=True)]
        else:
            outs = [lin(x.select(self.layout.input_dim, g)) for g, lin in enumerate(linears)]
        if self.layout.outputs == "list":
            return outs
        if self.layout.outputs == "concat":
            return torch.cat(outs, dim=-1)
        return torch.stack(outs, dim=self.layout.output_dim)

    def loka_gemm_operands(self, args: tuple, output: Any) -> list[dict]:
        """Probe's site protocol: one GEMM per linear, each reading its group's slice."""
        x = args[0]
        entries = []
        for g, lin in enumerate(self.linears):
            if self.layout.inputs == "shared":
                xg = x
            elif self.layout.inputs == "list":
                xg = x[g]
            else:
                xg = x.select(self.layout.input_dim, g)
            entry = {"input": xg, "weight": lin.weight, "bias": lin.bias is not None}
            if self.layout.outputs == "list":
                entry["output"] = output[g]
            else:
                entry["output"] = output
                entry["grad"] = _group_grad(self.layout, g, lin.out_features)
            entries.append(entry)
        return entries

    def extra_repr(self) -> str:
        return f"groups={len(self.linear_names)}, layout={self.layout}, backend={self.backend!r}"


def _group_grad(layout: GroupLayout, g: int, N: int):
    if layout.outputs == "concat":
        return lambda d: d[..., g * N : (g + 1) * N]
    return lambda d: d.select(layout.output_dim, g)


def _bmm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _fp8_plan(config: Fp8LinearConfig | None) -> LinearPlan:
    if config is None:
        raise GroupingError("backend 'fp8' needs an Fp8LinearConfig")
    for pass_, pass_config in config.passes().items():
        recipe = pass_config.recipe
        if recipe.is_bf16:
            continue
        if recipe.granularity != "row" or recipe.delayed:
            raise GroupingError(
                f"grouped FP8 runs rowwise dynamic recipes only; {pass_} asks for {recipe}"
            )
        backend = pass_config.backend
        if backend is not None and registry.get(backend).op != "grouped_mm":
            raise GroupingError(f"{pass_}: {backend!r} is not a grouped_mm backend")
    if config.pad:
        raise GroupingError("grouped FP8 does not pad shapes (the grouped kernel needs none)")
    return LinearPlan.of(config)


def _quantize_rows(t: torch.Tensor, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, inverse row scales) of a [G, R, C] tensor quantized as [G*R, C]."""
    flat = t.reshape(-1, t.shape[-1])
    data, _, inv, _ = call("quantize", flat, config, None, flat.shape[0], flat.shape[1])
    return data, inv


class GroupedFp8Function(torch.autograd.Function):
    """``y[g] = x[g] W[g]^T + b[g]`` for ``x [G, M, K]``, ``W [G, N, K]``, each pass FP8
    (rowwise, grouped GEMM) or high precision (bmm) as the plan says."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan, compute_dtype: torch.dtype):
        G = x.shape[0]
        if plan.fwd_x:
            xd, xi = _quantize_rows(x, plan.fwd_x)
            wd, wi = _quantize_rows(weight, plan.fwd_w)
            y = call(
                "grouped_mm", xd, xi, plan.fwd_x, wd, wi, plan.fwd_w, G, bias, plan.fwd_backend,
                GEMM_OUT_DTYPE,
            )  # fmt: skip
            y = cast(y, compute_dtype)
        else:
            y = _bmm(cast(x, compute_dtype), cast(weight, compute_dtype), bias)
        ctx.plan, ctx.compute_dtype = plan, compute_dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan: LinearPlan = ctx.plan
        x, weight = ctx.saved_tensors
        G = x.shape[0]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        cdt = ctx.compute_dtype
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if plan.dgrad_dy:
                dyd, dyi = _quantize_rows(dy, plan.dgrad_dy)
                wtd, wti = _quantize_rows(weight.transpose(1, 2), plan.dgrad_wt)
                dx = call(
                    "grouped_mm", dyd, dyi, plan.dgrad_dy, wtd, wti, plan.dgrad_wt, G, None,
                    plan.dgrad_backend, GEMM_OUT_DTYPE,
                )  # fmt: skip
            else:
                dx = torch.bmm(cast(dy, cdt), cast(weight, cdt))
            dx = cast(dx, x_dtype)
        if ctx.needs_input_grad[1]:
            if plan.wgrad_dyt:
                dytd, dyti = _quantize_rows(dy.transpose(1, 2), plan.wgrad_dyt)
                xtd, xti = _quantize_rows(x.transpose(1, 2), plan.wgrad_xt)
                dw = call(
                    "grouped_mm", dytd, dyti, plan.wgrad_dyt, xtd, xti, plan.wgrad_xt, G, None,
                    plan.wgrad_backend, GEMM_OUT_DTYPE,
                )  # fmt: skip
            else:
                dw = torch.bmm(cast(dy, cdt).transpose(1, 2), cast(x, cdt))
            dw = cast(dw, w_dtype)
        if ctx.needs_input_grad[2]:
            db = cast(bias_gradient(dy, plan.bias_grad), b_dtype)
        return dx, dw, db, None, None


# --- detection ------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and (a is b or torch.equal(a, b))
    )


def _is_list_of(obj: Any, parts: Sequence[torch.Tensor]) -> bool:
    return (
        isinstance(obj, (list, tuple))
        and len(obj) == len(parts)
        and all(_same(o, p) for o, p in zip(obj, parts, strict=True))
    )


def _stacked_dim(t: torch.Tensor, parts: Sequence[torch.Tensor]) -> int | None:
    """The dim (not the last) along which `t` is ``torch.stack(parts)``, if any."""
    for dim in range(t.dim() - 1):
        if t.shape[dim] == len(parts) and all(
            _same(t.select(dim, g), p) for g, p in enumerate(parts)
        ):
            return dim
    return None


def _input_layout(arg: Any, inputs: Sequence[torch.Tensor]) -> tuple[str, int] | None:
    if _is_list_of(arg, inputs):
        return "list", 0
    if not isinstance(arg, torch.Tensor):
        return None
    if all(x is arg for x in inputs):
        return "shared", 0
    dim = _stacked_dim(arg, inputs)
    return None if dim is None else ("stacked", dim)


def _output_layout(out: Any, outputs: Sequence[torch.Tensor]) -> tuple[str, int] | None:
    if _is_list_of(out, outputs):
        return "list", 0
    if not isinstance(out, torch.Tensor):
        return None
    if _same(out, torch.cat(list(outputs), dim=-1)):
        return "concat", 0
    dim = _stacked_dim(out, outputs)
    return None if dim is None else ("stacked", dim)


def detect_group_layout(model: nn.Module, name: str, example: Any) -> GroupLayout:
    """Run `model` on `example` and read how container `name` calls its linears: every call
    must hand linear g its g-th input as one of the layouts of `GroupLayout`, and return
    their outputs as one of its output layouts. Raises `GroupingError` saying what differs."""
    container = model.get_submodule(name)
    linears = group_linears(container)
    calls: list[tuple[tuple, dict, Any]] = []
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {id(m): [] for _, m in linears}

    def on_container(module, args, kwargs, output):
        calls.append((args, kwargs, output))

    def on_linear(module, args, output):
        seen[id(module)].append((args[0], output))

    handles = [container.register_forward_hook(on_container, with_kwargs=True)]
    handles += [m.register_forward_hook(on_linear) for _, m in linears]
    with _hooks(handles):
        run_model(model, example)
    if not calls:
        raise GroupingError(f"{name!r} was not called on the sample batch")
    if any(len(s) != len(calls) for s in seen.values()):
        raise GroupingError(f"{name!r}: its linears did not each run once per call")
    layouts = set()
    for i, (args, kwargs, output) in enumerate(calls):
        if len(args) != 1 or kwargs:
            raise GroupingError(f"{name!r} takes more than one argument; grouping needs one")
        inputs = [seen[id(m)][i][0] for _, m in linears]
        outputs = [seen[id(m)][i][1] for _, m in linears]
        found_in = _input_layout(args[0], inputs)
        found_out = _output_layout(output, outputs)
        if found_in is None or found_out is None:
            what = "inputs" if found_in is None else "outputs"
            raise GroupingError(
                f"{name!r}: its linears' {what} are not the groups of its own {what} "
                "(stacked along a dim, a list, shared, or concatenated)"
            )
        layouts.add(GroupLayout(found_in[0], found_in[1], found_out[0], found_out[1]))
    if len(layouts) != 1:
        raise GroupingError(f"{name!r} used different layouts in different calls: {layouts}")
    return layouts.pop()


def group_candidates(model: nn.Module) -> list[str]:
    """Modules (outermost first, not nested in one another) whose parameters are exactly
    two or more equal-shape linears: what automatic grouping tries."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Linear)):
            continue
        if any(name.startswith(prefix + ".") for prefix in found):
            continue
        try:
            group_linears(module)
        except GroupingError:
            continue
        found.append(name)
    return found
