"""The error of one GEMM pass under each candidate recipe, against a float64 reference.

A pass computes `A @ B.T` with operands in pass layout (see `quantize`):

| pass  | A                    | B                  | output    |
| ----- | -------------------- | ------------------ | --------- |
| fwd   | x `[m, K]`           | W `[N, K]`         | `[m, N]`  |
| dgrad | dY `[m, N]`          | W.T `[K, N]`       | `[m, K]`  |
| wgrad | dY.T `[N, m]`        | x.T `[K, m]`       | `[N, K]`  |

The error statistic is the *balanced* relative error: every output entry `out[i, j]` is
divided by the norms `||A[i]|| * ||B[j]||` of the operand rows that produce it (the scale
of a dot product's rounding error) before the relative Frobenius error is taken. Every
token (row) and every output channel (column) then weighs the same whatever its
magnitude, so an FP8 recipe that wipes out small rows or columns (tensorwise scaling next
to outlier channels, e4m3 on gradients of a wide dynamic range) is seen although the
largest entries, which FP8 always keeps, dominate a plain Frobenius norm. Dividing by the
operands' norms rather than by the output's own rows and columns keeps outputs that
cancel to near zero (a logit layer, N = 1) from inflating the statistic. On
well-conditioned data the balanced and plain errors agree.

Every function returns sums (numerator and denominator squares, max), so that several GEMMs
of one site (a grouped site) combine by addition before the ratio is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loka.probe.quantize import quantize_operand
from loka.probe.scaled_mm import scaled_mm
from loka.schema import QuantConfig, Recipe
from loka.schema.fp8 import dequantize

# Columns of the per-GEMM error sums.
BAL_NUM, BAL_DEN, ERR_SQ, REF_SQ, MAX_ABS = range(5)
N_SUMS = 5


@dataclass
class PassOperands:
    """The two operands of one pass in pass layout, with the amaxes of the full tensors
    they were sampled from (rows of activations and gradients are subsampled)."""

    a: torch.Tensor
    b: torch.Tensor
    a_weight: bool
    b_weight: bool
    a_amax: torch.Tensor
    b_amax: torch.Tensor
    a_row_amax: torch.Tensor | None = None
    b_row_amax: torch.Tensor | None = None
    # history length H -> (max amax of A, of B) over the H steps before this one
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def balance_weights(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-entry weights `1 / (||a[i]|| * ||b[j]||)` of the output `a @ b.T` (float64);
    zero where an operand row is all zero."""
    norms = [t.double().pow(2).sum(dim=1).sqrt() for t in (a, b)]
    inv = [torch.where(n > 0, n.reciprocal(), torch.zeros_like(n)) for n in norms]
    return inv[0][:, None] * inv[1][None, :]


def error_sums(out: torch.Tensor, ref: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[balanced error^2, balanced reference^2, error^2, reference^2, max |error|]."""
    err = out.double() - ref
    return torch.stack(
        [
            (err * weights).pow(2).sum(),
            (ref * weights).pow(2).sum(),
            err.pow(2).sum(),
            ref.pow(2).sum(),
            err.abs().amax() if err.numel() else err.new_zeros(()),
        ]
    )


def missing_sums(like: torch.Tensor) -> torch.Tensor:
    """Error sums of a measurement that could not be taken (NaN: skipped on the host)."""
    return torch.full((N_SUMS,), float("nan"), dtype=torch.float64, device=like.device)


def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The bf16 GEMM as a GPU runs it: bf16 operands, wide accumulation, bf16 output."""
    return (a.bfloat16().double() @ b.bfloat16().double().T).bfloat16()


class _Quantized:
    """Quantized operands of one pass, shared between recipes that scale an operand alike."""

    def __init__(self, ops: PassOperands) -> None:
        self.ops = ops
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, side: str, recipe: Recipe, history: int) -> tuple[torch.Tensor, ...]:
        ops = self.ops
        config: QuantConfig = recipe.operand(side, ops.a_weight if side == "a" else ops.b_weight)
        key = (side, config, history)
        if key not in self._cache:
            x = ops.a if side == "a" else ops.b
            if history:
                tensor_amax = ops.history[history][0 if side == "a" else 1]
            else:
                tensor_amax = ops.a_amax if side == "a" else ops.b_amax
            row_amax = ops.a_row_amax if side == "a" else ops.b_row_amax
            self._cache[key] = quantize_operand(
                x, config, tensor_amax=tensor_amax, row_amax=row_amax
            )
        return self._cache[key]


def pass_error_sums(
    ops: PassOperands,
    recipes: Sequence[Recipe],
    *,
    out_dtype: torch.dtype,
    real_fp8: bool = False,
) -> tuple[torch.Tensor, list[bool]]:
    """Error sums `[1 + len(recipes), N_SUMS]` (row 0: the bf16 GEMM) and, per recipe,
    whether FP8 was emulated (False: it ran on FP8 tensor cores).

    A delayed recipe whose history is missing gets NaN sums (no measurement).
    """
    ref = ops.a.double() @ ops.b.double().T
    weights = balance_weights(ops.a, ops.b)
    rows = [error_sums(bf16_gemm(ops.a, ops.b), ref, weights)]
    emulated: list[bool] = []
    quantized = _Quantized(ops)
    for recipe in recipes:
        history = recipe.history if recipe.scaling == "delayed" else 0
        if history and history not in ops.history:
            rows.append(missing_sums(ref))
            emulated.append(True)
            continue
        a_q, a_scale = quantized.get("a", recipe, history)
        b_q, b_scale = quantized.get("b", recipe, history)
        out = None
        if real_fp8:
            out = scaled_mm(a_q, a_scale, b_q, b_scale, recipe.granularity, out_dtype)
        emulated.append(out is None)
        if out is None:
            out = (dequantize(a_q, a_scale) @ dequantize(b_q, b_scale).T).to(out_dtype)
        rows.append(error_sums(out, ref, weights))
    return torch.stack(rows), emulated


def relative_errors(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(balanced, plain Frobenius) relative errors from error sums `[..., N_SUMS]`."""
    return (
        (sums[..., BAL_NUM] / sums[..., BAL_DEN]).sqrt(),
        (sums[..., ERR_SQ] / sums[..., REF_SQ]).sqrt(),
    )
