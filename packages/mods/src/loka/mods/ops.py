"""The loka.kernels calls of the FP8 modules as torch.library custom ops (``loka_mods::*``).

`torch.compile` sees each op as one opaque node with a fake-tensor implementation (shapes and
dtypes only), so a compiled model keeps no graph break around our Triton kernels. In eager
mode the modules call the same Python implementations directly (`call`), skipping the
dispatcher's per-call overhead (`mm` then wraps its operands, which these ops made, unchecked).

Ops take plain tensors and scalars: an FP8 operand is its data and scales, and a quantization
config travels as its string (`str(loka.schema.QuantConfig)`, read back by `decode`). Every quantizing op can pad its
output with zeros to ``[rows, cols]`` (shape alignment, `loka.mods.alignment`): zeros change
no amax, so padding the FP8 bytes after quantizing equals quantizing the padded tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loka.kernels import Fp8Tensor, fp8_mm, grouped_mm, norm_backward, norm_quantize
from loka.kernels.quantization import quantize_with
from loka.kernels.transpose_quantization import quantize_transpose_with
from loka.mods.eager_graphs import EagerGraphs
from loka.mods.weight_stamp import weight_stamp
from loka.schema import QuantConfig
from loka.schema.fp8 import finite_abs
from loka.schema.recipe import scale_grid

NAMESPACE = "loka_mods"
_EMPTY_SHAPE = (0,)
# custom_op infers its schema from these annotations: fixed-length tuples of tensors.
_T = torch.Tensor
_Four = tuple[_T, _T, _T, _T]
_Seven = tuple[_T, _T, _T, _T, _T, _T, _T]
_Eight = tuple[_T, _T, _T, _T, _T, _T, _T, _T]


decode = QuantConfig.parse  # the config of a custom op's string argument (cached)


def _padded(t: Fp8Tensor, rows: int, cols: int) -> Fp8Tensor:
    """`t` with zero rows and columns appended up to ``[rows, cols]``; new scale groups get
    scale 1 and amax 0, as quantizing zeros gives."""
    R, C = t.shape
    if (rows, cols) == (R, C):
        return t
    if rows < R or cols < C:
        raise ValueError(f"cannot pad a [{R}, {C}] operand to [{rows}, {cols}]")
    data = F.pad(t.data.view(torch.uint8), (0, cols - C, 0, rows - R)).view(t.data.dtype)
    grid = scale_grid(rows, cols, t.granularity, t.block)
    grown = []
    for values, fill in ((t.scale, 1.0), (t.inv_scale, 1.0), (t.amax, 0.0)):
        if tuple(values.shape) == grid:
            grown.append(values)
            continue
        full = values.new_full(grid, fill)
        full[tuple(slice(0, n) for n in values.shape)] = values
        grown.append(full)
    return Fp8Tensor(data, *grown, t.fmt, t.granularity, t.block)


def _fields(t: Fp8Tensor) -> tuple[torch.Tensor, ...]:
    return t.data, t.scale, t.inv_scale, t.amax


def _fake_fields(rows: int, cols: int, config: QuantConfig, like: torch.Tensor):
    grid = config.scale_shape(rows, cols)
    data = like.new_empty((rows, cols), dtype=config.dtype)
    return data, *(like.new_empty(grid, dtype=torch.float32) for _ in range(3))


def operand(data: torch.Tensor, inv_scale: torch.Tensor, config_text: str) -> Fp8Tensor:
    """An FP8 GEMM operand from its data and inverse scales. GEMMs read only ``inv_scale``,
    so it also fills the ``scale`` and ``amax`` slots (which only their shapes are checked)."""
    config = decode(config_text)
    return Fp8Tensor(
        data, inv_scale, inv_scale, inv_scale, config.fmt, config.granularity, config.block
    )


def _own_operand(data: torch.Tensor, inv_scale: torch.Tensor, config_text: str) -> Fp8Tensor:
    """`operand` without Fp8Tensor's checks, for operands this module's quantizing ops made
    (to the checked layout, for this very config): the checks cost 2-3x the wrapper, six
    times per eager fwd+bwd of an FP8 linear."""
    config = decode(config_text)
    return Fp8Tensor._trusted(
        data, inv_scale, inv_scale, inv_scale, config.fmt, config.granularity, config.block
    )


# --- quantize -------------------------------------------------------------------------------


def quantize_impl(
    x: torch.Tensor, config: str, amax: torch.Tensor | None, rows: int, cols: int
) -> _Four:
    return _fields(_padded(quantize_with(x, decode(config), amax), rows, cols))


def _quantize_fake(x, config, amax, rows, cols):
    return _fake_fields(rows, cols, decode(config), x)


# --- quantize_transpose ---------------------------------------------------------------------


def quantize_transpose_impl(
    x: torch.Tensor, config: str, amax: torch.Tensor | None, rows: int, cols: int
) -> _Eight:
    q, qt = quantize_transpose_with(x, decode(config), amax)
    t_fields = _fields(_padded(qt, cols, rows))
    if q.granularity == "tensor":
        # x and x^T share one amax, scale and inverse scale; a custom op may not return
        # aliased outputs, so the transpose gets copies (three one-element tensors).
        t_fields = (t_fields[0], *(t.clone() for t in t_fields[1:]))
    return (*_fields(_padded(q, rows, cols)), *t_fields)


def _quantize_transpose_fake(x, config, amax, rows, cols):
    cfg = decode(config)
    return (*_fake_fields(rows, cols, cfg, x), *_fake_fields(cols, rows, cfg, x))


# --- mm -------------------------------------------------------------------------------------


def mm_impl(
    a_data: torch.Tensor,
    a_inv_scale: torch.Tensor,
    a_config: str,
    b_data: torch.Tensor,
    b_inv_scale: torch.Tensor,
    b_config: str,
    bias: torch.Tensor | None,
    backend: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of two FP8 operands; backend "" takes the best that runs it."""
    return _product(operand, a_data, a_inv_scale, a_config, b_data, b_inv_scale, b_config,
                    bias, backend, out_dtype)  # fmt: skip


def mm_eager(*args) -> torch.Tensor:
    """`mm_impl` as LoKA's autograd functions call it eagerly (`call`): their operands are
    outputs of this module's quantizing ops (the activations' per call, the weight's once per
    refresh), so they are wrapped unchecked. The registered op, which compiled graphs and
    other callers reach, checks them as before; `fp8_mm` and the backend still check what
    they always did (shapes, devices, bias)."""
    return _product(_own_operand, *args)


def _product(wrap, a_data, a_inv_scale, a_config, b_data, b_inv_scale, b_config, bias,
             backend, out_dtype) -> torch.Tensor:  # fmt: skip
    a = wrap(a_data, a_inv_scale, a_config)
    b = wrap(b_data, b_inv_scale, b_config)
    return fp8_mm(a, b, bias=bias, out_dtype=out_dtype, backend=backend or None)


def _mm_fake(
    a_data, a_inv_scale, a_config, b_data, b_inv_scale, b_config, bias, backend, out_dtype
):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


# --- grouped_mm -----------------------------------------------------------------------------


def grouped_mm_impl(
    a_data: torch.Tensor,
    a_inv_scale: torch.Tensor,
    a_config: str,
    b_data: torch.Tensor,
    b_inv_scale: torch.Tensor,
    b_config: str,
    groups: int,
    bias: torch.Tensor | None,
    backend: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[G, Ma, Nb]``: ``a_g @ b_g^T (+ bias_g)`` for FP8 operands ``a [G*Ma, K]`` and
    ``b [G*Nb, K]`` with row scales, split into G equal blocks of rows; `bias` is ``[G, Nb]``."""
    ma, nb = a_data.shape[0] // groups, b_data.shape[0] // groups

    def split(data, inv, config, rows):
        return [
            operand(data[g * rows : (g + 1) * rows], inv[g * rows : (g + 1) * rows], config)
            for g in range(groups)
        ]

    outs = grouped_mm(
        split(a_data, a_inv_scale, a_config, ma), split(b_data, b_inv_scale, b_config, nb),
        bias=None if bias is None else list(bias.unbind(0)), out_dtype=out_dtype,
        backend=backend or None,
    )  # fmt: skip
    return torch.stack(outs)


def _grouped_mm_fake(
    a_data, a_inv_scale, a_config, b_data, b_inv_scale, b_config, groups, bias, backend, out_dtype
):
    shape = (groups, a_data.shape[0] // groups, b_data.shape[0] // groups)
    return a_data.new_empty(shape, dtype=out_dtype)


# --- norm_quantize --------------------------------------------------------------------------


def norm_quantize_impl(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kind: str,
    config: str,
    return_normed: bool,
    cols: int,
) -> _Seven:
    """(FP8 data, scale, inv_scale, amax, normed or empty, mean or empty, rstd)."""
    cfg = decode(config)
    out = norm_quantize(
        x, weight, bias, eps, kind=kind, fmt=cfg.fmt, pow2=cfg.pow2, scale_ub=cfg.scale_ub,
        return_normed=return_normed,
    )  # fmt: skip
    # New empties each: a custom op may not return one tensor twice.
    normed = out.normed if out.normed is not None else x.new_empty(_EMPTY_SHAPE)
    mean = out.mean if out.mean is not None else x.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return (*_fields(_padded(out.q, x.shape[0], cols)), normed, mean, out.rstd)


def _norm_quantize_fake(x, weight, bias, eps, kind, config, return_normed, cols):
    M = x.shape[0]
    fields = _fake_fields(M, cols, decode(config), x)
    normed = x.new_empty(x.shape if return_normed else _EMPTY_SHAPE)
    mean = x.new_empty((M,) if kind == "layernorm" else _EMPTY_SHAPE, dtype=torch.float32)
    return (*fields, normed, mean, x.new_empty((M,), dtype=torch.float32))


# --- norm_backward --------------------------------------------------------------------------


def norm_backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    kind: str,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty)."""
    dx, dw, db = norm_backward(dy, x, weight, mean, rstd, kind=kind, has_bias=has_bias)
    # New empties each: a custom op may not return one tensor twice.
    dw = dw if dw is not None else x.new_empty(_EMPTY_SHAPE)
    return dx, dw, db if db is not None else x.new_empty(_EMPTY_SHAPE)


def _norm_backward_fake(dy, x, weight, mean, rstd, kind, has_bias):
    dw = x.new_empty(weight.shape, dtype=weight.dtype) if weight is not None else None
    db_dtype = weight.dtype if weight is not None else x.dtype
    db = x.new_empty((x.shape[1],), dtype=db_dtype) if has_bias else None
    dw = dw if dw is not None else x.new_empty(_EMPTY_SHAPE)
    return x.new_empty(x.shape), dw, db if db is not None else x.new_empty(_EMPTY_SHAPE)


# --- refresh_weight -------------------------------------------------------------------------


def refresh_weight_impl(
    weight: torch.Tensor,
    key: torch.Tensor,
    cache: list[torch.Tensor],
    history: torch.Tensor,
    fwd_config: str,
    dgrad_config: str,
    fwd_delayed: bool,
    dgrad_delayed: bool,
    rows: int,
    cols: int,
) -> None:
    """Re-quantize `weight` into `cache` in place if it changed since the last call.

    `key` (int64 CPU ``[3]``) holds the weight's stamp at the last refresh (`weight_stamp`:
    version counter, data pointer, optimizer-step generation): ``load_state_dict`` or an
    in-place edit bumps the version, every optimizer step (fused ones too, which leave the
    version alone) the generation of trainable weights, and a move to another device
    changes the pointer. `cache` holds data, scale, inv_scale, amax
    of W ``[rows, cols]`` (fwd layout, for config `fwd_config`) then of W^T ``[cols, rows]``
    (dgrad layout, `dgrad_config`); a layout whose config is "" is not made. `history` is the
    weight's amax history: a layout marked delayed takes its scale from the history's maximum
    once it holds a value (before: the current amax), and the measured amax is pushed to it.
    """
    stamp = weight_stamp(weight)
    if tuple(int(v) for v in key) == stamp:
        return
    for offset, made in _requantized_layouts(weight, history, fwd_config, dgrad_config,
                                             fwd_delayed, dgrad_delayed, rows, cols):  # fmt: skip
        for target, value in zip(cache[offset : offset + len(made)], made, strict=True):
            target.copy_(value)
    key[0], key[1], key[2] = stamp


def refresh_weight_eager(
    weight: torch.Tensor,
    key: torch.Tensor,
    cache: list[torch.Tensor],
    history: torch.Tensor,
    *layouts: str | bool | int,
    graphs: EagerGraphs | None = None,
) -> None:
    """`refresh_weight_impl` (the same arguments) outside a compiled graph: the new FP8 copies
    replace the cache's entries instead of being copied into them. No copy kernels (eight
    launches and two weight-sized copies per refresh), and a backward still pending from
    before the refresh keeps the W^T it saved. With `graphs` (given where they are usable:
    `Fp8Linear._graphs_for`) the quantization replays a CUDA graph (`loka.mods.eager_graphs`;
    its outputs become the cache, and a pending backward keeps the module from replaying it)."""
    if graphs is not None:
        made = graphs.run("weight", _requantized_layouts, (weight, history), layouts)
    else:
        made = _requantized_layouts(weight, history, *layouts)
    for offset, tensors in made:
        cache[offset : offset + len(tensors)] = list(tensors)
    key[0], key[1], key[2] = weight_stamp(weight)


def _requantized_layouts(
    weight, history, fwd_config, dgrad_config, fwd_delayed, dgrad_delayed, rows, cols
) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """The weight's FP8 layouts as (offset in the cache, (data, scale, inv_scale, amax, ...));
    a delayed layout's measured amax is pushed to `history`."""
    w = weight.detach()
    delayed_amax = None
    if fwd_delayed or dgrad_delayed:
        # where() rather than a branch on the history's content: no device-to-host sync.
        recorded = history.amax().reshape(1).float()
        delayed_amax = torch.where(recorded > 0, recorded, finite_abs(w).amax().reshape(1))
    fwd_amax = delayed_amax if fwd_delayed else None
    dgrad_amax = delayed_amax if dgrad_delayed else None
    layouts = []
    if fwd_config and (dgrad_config, dgrad_delayed) == (fwd_config, fwd_delayed):
        layouts.append((0, quantize_transpose_impl(w, fwd_config, fwd_amax, rows, cols)))
    else:
        if fwd_config:
            layouts.append((0, quantize_impl(w, fwd_config, fwd_amax, rows, cols)))
        if dgrad_config:
            layouts.append((4, quantize_impl(w.t(), dgrad_config, dgrad_amax, cols, rows)))
    if delayed_amax is not None:
        measured = finite_abs(w).amax().reshape(1).to(history.dtype)
        history.copy_(torch.cat([measured, history[:-1]]))
    return layouts


def _refresh_weight_fake(
    weight, key, cache, history, fwd_config, dgrad_config, fwd_delayed, dgrad_delayed, rows, cols
):
    return None


# --- registration ---------------------------------------------------------------------------


def _no_gradient(ctx, inputs: tuple, output) -> None:
    outputs = output if isinstance(output, tuple) else (output,)
    ctx.mark_non_differentiable(*outputs)


def _no_backward(ctx, *grads):
    raise RuntimeError(f"{NAMESPACE} ops have no gradient")  # outputs are non-differentiable


def _register(
    name: str, impl: Callable, fake: Callable, mutates_args: tuple[str, ...] = ()
) -> Callable:
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    if not mutates_args:
        # Quantizing and FP8 GEMMs have no gradient of their own: the autograd.Functions that
        # call them (`linear_function`, `norm_linear`, `grouped`) define the backward. Saying
        # so keeps outputs from requiring grad when an op is called on inputs that do.
        op.register_autograd(_no_backward, setup_context=_no_gradient)
    return getattr(getattr(torch.ops, NAMESPACE), name)


_OPS = {
    "quantize": (quantize_impl, _register("quantize", quantize_impl, _quantize_fake)),
    "quantize_transpose": (
        quantize_transpose_impl,
        _register("quantize_transpose", quantize_transpose_impl, _quantize_transpose_fake),
    ),
    "mm": (mm_eager, _register("mm", mm_impl, _mm_fake)),
    "grouped_mm": (grouped_mm_impl, _register("grouped_mm", grouped_mm_impl, _grouped_mm_fake)),
    "norm_quantize": (
        norm_quantize_impl,
        _register("norm_quantize", norm_quantize_impl, _norm_quantize_fake),
    ),
    "norm_backward": (
        norm_backward_impl,
        _register("norm_backward", norm_backward_impl, _norm_backward_fake),
    ),
    "refresh_weight": (
        refresh_weight_impl,
        _register(
            "refresh_weight",
            refresh_weight_impl,
            _refresh_weight_fake,
            mutates_args=("key", "cache", "history"),
        ),
    ),
}


def call(name: str, *args):
    """Run op `name`: through the dispatcher while torch.compile traces, directly otherwise."""
    impl, op = _OPS[name]
    return op(*args) if torch.compiler.is_compiling() else impl(*args)
