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

Probe keeps a sample of m of a call's M tokens. Fwd and dgrad reduce over features, so a
sampled token's output is the real one. Wgrad reduces over the tokens themselves, and the
sample's m-token sum misstates the M-token GEMM: quantization errors that are independent
from token to token grow like M, while the coherent part of the gradient grows like M^2.
Measured on the xl presets at M = 16384 (H200), a 1024-token sample read up to 2.4x the
whole batch's error. So `pass_error_sums` estimates the M-token sums when
`PassOperands.m_total` says more tokens were there (`extrapolate_sums`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from loka.probe.quantize import quantize_operand
from loka.probe.scaled_mm import scaled_mm
from loka.schema import QuantConfig, Recipe
from loka.schema.fp8 import dequantize

# Columns of the per-GEMM error sums.
BAL_NUM, BAL_DEN, ERR_SQ, REF_SQ, MAX_ABS, VAR_NUM, VAR_DEN, SUM_NUM, SUM_DEN = range(9)
N_SUMS = 9
# How far above zero (in its standard deviations) a sampled wgrad's pair term must stand
# before the reference counts it as coherent (`extrapolate_sums`).
PAIR_Z = 2.0


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
    # Wgrad only: the tokens the reduction ran over, of which the columns of a and b are a
    # uniform sample. None: the reduction is not sampled.
    m_total: int | torch.Tensor | None = None
    # Fwd and dgrad: the output's rows are tokens, so the varying sums (`error_sums`) take
    # the part of each output channel that varies from token to token.
    token_rows: bool = False
    # Dgrad: the output's rows are a uniform sample of this many tokens, and the output's
    # sum over all of them is what the gradients upstream are made of (`summed_square`).
    # None: the summed sums repeat the balanced ones.
    summed_total: int | torch.Tensor | None = None
    # history length H -> (max amax of A, of B) over the H steps before this one
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def inverse_row_norms(t: torch.Tensor) -> torch.Tensor:
    """`1 / ||t[i]||` per row (float64); zero where a row is all zero."""
    norms = t.double().pow(2).sum(dim=1).sqrt()
    return torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))


def balance_weights(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-entry weights `1 / (||a[i]|| * ||b[j]||)` of the output `a @ b.T` (float64);
    zero where an operand row is all zero."""
    return inverse_row_norms(a)[:, None] * inverse_row_norms(b)[None, :]


def error_sums(
    out: torch.Tensor,
    ref: torch.Tensor,
    weights: torch.Tensor,
    token_rows: bool = False,
    summed: tuple[torch.Tensor, int] | None = None,
    reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """[balanced error^2, balanced reference^2, error^2, reference^2, max |error|, varying
    error^2, varying reference^2, summed error^2, summed reference^2].

    The varying sums are the balanced ones after each output channel's mean over the tokens
    is taken out (`token_rows`; otherwise they repeat the balanced sums). They are what
    tells examples apart: a layer whose output is nearly the same for every token (a model
    on a loss plateau, whose hidden states collapse towards one vector) can show a 1-2%
    error overall and 300% of the part that varies (DHEN large, `blocks.1-3.fc1` fwd
    rowwise e4m3), an error the plain statistic never shows.

    The summed sums (`summed`: the output columns' balance weights and the tokens the rows
    were sampled from; otherwise they repeat the balanced sums) are those of the output's
    sum over the tokens (`summed_square`).

    `reference`: `reference_sums` of the same arguments, when several outputs are judged
    against one reference (every recipe of a pass): taken once instead of per output."""
    if reference is None:
        reference = reference_sums(ref, weights, token_rows, summed)
    bal_den, ref_sq, var_den, sum_den = reference.unbind()
    err = out.double() - ref
    bal_err = err * weights
    bal_num = bal_err.pow(2).sum()
    many = err.shape[0] > 1
    var_num = (bal_err - bal_err.mean(dim=0)).pow(2).sum() if token_rows and many else bal_num
    sum_num = summed_square(err, *summed) if summed is not None and many else bal_num
    max_abs = err.abs().amax() if err.numel() else err.new_zeros(())
    return torch.stack(
        [bal_num, bal_den, err.pow(2).sum(), ref_sq, max_abs, var_num, var_den, sum_num, sum_den]
    )


def reference_sums(
    ref: torch.Tensor,
    weights: torch.Tensor,
    token_rows: bool = False,
    summed: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The reference's side of `error_sums`: [balanced reference^2, reference^2, varying
    reference^2, summed reference^2] (the last two repeat the first where `error_sums`
    repeats the balanced sums)."""
    bal_ref = ref * weights
    bal_den = bal_ref.pow(2).sum()
    many = ref.shape[0] > 1
    var_den = (bal_ref - bal_ref.mean(dim=0)).pow(2).sum() if token_rows and many else bal_den
    sum_den = summed_square(ref, *summed) if summed is not None and many else bal_den
    return torch.stack([bal_den, ref.pow(2).sum(), var_den, sum_den])


def summed_square(
    t: torch.Tensor, column_weights: torch.Tensor, m_total: int | torch.Tensor
) -> torch.Tensor:
    """The square of a token-row output's sum over all `m_total` tokens, per column weighted
    by `column_weights`, estimated from the `m` sampled rows of `t` (`[m, columns]`,
    float64): of an error (the summed error^2) or of the reference.

    A dgrad output's sum over the tokens is what the gradients upstream are made of: every
    bias gradient there, and the weight gradients wherever the inputs there collapse
    towards one shared vector (their outer product with it). On a loss plateau the tokens'
    gradients cancel in that sum while the rounding errors of inputs that share their
    structure do not: DHEN large's `blocks.*.fc2` dgrad in rowwise e4m3 errs 1.2-1.4%
    per token and 15-19% on the sum over 1024 tokens (bf16: 0.6%), and the cancelling
    sum grows like sqrt(M) where the coherent error grows like M.

    The sample's sum misstates the M-token one for that reason, so it is extrapolated as
    a wgrad's is (`extrapolate_sums`): from two random halves A and B of the sample,
    ``s T^2 + c T_A T_B`` with s = M/m and c = M(M-m)/(m_A m_B). The pair term counts
    only as far as it stands `PAIR_Z` standard deviations above zero: a sum has
    as many entries as the output has columns, too few for the pair term of independent
    errors to average out, and c is large (~4000 at m = 512 of M = 16384)."""
    w2 = column_weights.pow(2)
    m = t.shape[0]
    if m < 4 or not exceeds(m_total, m):
        return (w2 * t.sum(dim=0).square()).sum()
    part_a, part_b = halves_on(m, t.device)
    m_a, m_b = len(part_a), len(part_b)
    s, c = m_total / m, m_total * (m_total - m) / (m_a * m_b)
    own, pairs, pairs_sq = pair_moments(
        t.index_select(0, part_a).sum(dim=0, keepdim=True),
        t.index_select(0, part_b).sum(dim=0, keepdim=True),
        w2[None, :],
    )[:3]
    return s * own + c * (pairs - PAIR_Z * pairs_sq.sqrt()).clamp(min=0)


def exceeds(total: int | torch.Tensor, m: int) -> bool:
    """Whether `total` tokens are more than the `m` sampled. A token count given as a tensor
    (an input of a CUDA graph, `loka.probe.error_graphs`, so that one graph serves batches of
    any size) is only given where they are: its value is never read on the host."""
    return isinstance(total, torch.Tensor) or total > m


def missing_sums(like: torch.Tensor) -> torch.Tensor:
    """Error sums of a measurement that could not be taken (NaN: skipped on the host)."""
    return torch.full((N_SUMS,), float("nan"), dtype=torch.float64, device=like.device)


class _Quantized:
    """Quantized operands of one pass, shared between recipes that scale an operand alike."""

    def __init__(self, ops: PassOperands) -> None:
        self.ops = ops
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._float: dict[str, torch.Tensor] = {}
        self._values: dict[tuple, torch.Tensor] = {}

    def _key(self, side: str, recipe: Recipe, history: int) -> tuple:
        """What an operand's quantization depends on: recipes alike there share it."""
        ops = self.ops
        config: QuantConfig = recipe.operand(side, ops.a_weight if side == "a" else ops.b_weight)
        return side, config, history

    def values(self, side: str, recipe: Recipe, history: int) -> torch.Tensor:
        """The operand's dequantized float64 values (`get`'s codes over its scales), made
        once for every recipe that quantizes the operand alike."""
        key = self._key(side, recipe, history)
        if key not in self._values:
            self._values[key] = dequantize(*self.get(side, recipe, history))
        return self._values[key]

    def get(self, side: str, recipe: Recipe, history: int) -> tuple[torch.Tensor, ...]:
        ops = self.ops
        key = self._key(side, recipe, history)
        _, config, _ = key
        if key not in self._cache:
            # float32 once per operand, not in every recipe's amax and cast
            x = self._float.get(side)
            if x is None:
                x = self._float[side] = (ops.a if side == "a" else ops.b).float()
            if history:
                tensor_amax = ops.history[history][0 if side == "a" else 1]
            else:
                tensor_amax = ops.a_amax if side == "a" else ops.b_amax
            row_amax = ops.a_row_amax if side == "a" else ops.b_row_amax
            self._cache[key] = quantize_operand(
                x, config, tensor_amax=tensor_amax, row_amax=row_amax
            )
        return self._cache[key]


@functools.lru_cache(maxsize=8)
def split_halves(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random split of `m` sampled tokens into two halves (index tensors, sorted).

    Random, not first and second half: the sample is sorted by position, and tokens that sit
    together (one example's sequence) are alike; a random split makes every pair of sampled
    tokens equally likely to fall across the halves, which `extrapolate_sums` needs.
    Fixed (seeded by m), so that a measurement repeats; made once per m (CPU tensors: do not
    modify)."""
    g = torch.Generator().manual_seed(104729 + m)
    order = torch.randperm(m, generator=g)
    half = m // 2
    return order[:half].sort().values, order[half:].sort().values


@functools.lru_cache(maxsize=16)
def halves_on(m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_halves(m)` on `device`, copied there once per device: not at every slice, and
    never inside a CUDA graph's capture (`loka.probe.error_graphs`), where a copy from the
    host fails; the first, eager analysis of a layout puts them there."""
    return tuple(p.to(device) for p in split_halves(m))


def extrapolate_sums(
    out_halves: Sequence[torch.Tensor],
    exact_halves: Sequence[torch.Tensor],
    ref_halves: Sequence[torch.Tensor],
    weights: torch.Tensor,
    m_total: int | torch.Tensor,
    sizes: tuple[int, int],
    ref_moments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Error sums of the whole M-token GEMM estimated from two halves of an m-token sample.

    Each half has three outputs: `ref` (float64 of the true operands), `exact` (the product
    of the rounded or dequantized operands, float32 or wider) and `out` (what the GEMM
    returns). Their differences are two errors that grow differently with M:

    - the operands' rounding, ``exact - ref``, is a sum over tokens. For one output entry,
      write the sample's sum as T = T_A + T_B over the halves. Over the random sample,
      ``s T^2 + c T_A T_B`` with s = M/m and c = M(M-m)/(m_A m_B) is an unbiased estimate
      of the M-token T_M^2: s scales the tokens' own squares (independent errors), and the
      across-halves product stands for every pair of distinct tokens (the coherent part,
      which grows like M^2). The reference is estimated the same way.
    - the output's own rounding and accumulation, ``out - exact``, is relative to the output:
      its relative size on the halves is carried over to the M-token reference.

    The pair part is noisy: it stands for M^2 pairs from m^2 / 4, so its spread shrinks only
    with the number of output entries summed (for a wide layer at m = 1024 of M = 16384 it
    is ~1% of the total, for a narrow one it can exceed it). The estimate is therefore kept
    on the safe side: the reference's pair term counts only as far as it stands above
    `PAIR_Z` of its standard deviations (a coherent gradient the sample cannot show is
    not assumed; without one the sample's own relative error is kept), and the operands'
    error counts its pair term whenever it is positive (errors are not assumed to cancel).
    The balanced weights come from the sample (their M-token values differ by the common
    factor s, taken out so that the sums stay comparable with an unsampled GEMM's).

    `ref_moments`: `reference_moments` of the same halves and weights, when several outputs
    are judged against one reference (every recipe of a pass): taken once, not per output."""
    m_a, m_b = sizes
    m = m_a + m_b
    s = m_total / m
    c = m_total * (m_total - m) / (m_a * m_b)
    w2 = (weights / s).pow(2)
    ref = reference_moments(ref_halves, weights, m_total, m) if ref_moments is None else ref_moments
    exact_halves = [e.double() for e in exact_halves]
    op = pair_moments(*(e - r for e, r in zip(exact_halves, ref_halves, strict=True)), w2)
    rounding = [o.double() - e for o, e in zip(out_halves, exact_halves, strict=True)]
    rounding_sq = sum(r.square() for r in rounding)
    exact_sq = sum(e.square() for e in exact_halves)
    sums = []
    for w, (own, pairs, pairs_sq) in ((w2, (0, 1, 2)), (None, (3, 4, 5))):
        coherent = (ref[pairs] - PAIR_Z * ref[pairs_sq].sqrt()).clamp(min=0)
        reference = s * ref[own] + c * coherent
        operands = s * op[own] + c * op[pairs].clamp(min=0)
        out_num, out_den = ((t if w is None else w * t).sum() for t in (rounding_sq, exact_sq))
        # where, not `if out_den > 0`: no host sync (the sums are captured in CUDA graphs)
        relative = torch.where(out_den > 0, out_num / out_den, 0.0)
        sums += [operands + relative * reference, reference]
    err = sum(o.double() - r for o, r in zip(out_halves, ref_halves, strict=True))
    sums.append(err.abs().amax() if err.numel() else err.new_zeros(()))
    # no token rows: the varying and summed sums are the balanced ones
    return torch.stack(sums + sums[:2] + sums[:2])


def reference_moments(
    ref_halves: Sequence[torch.Tensor], weights: torch.Tensor, m_total: int | torch.Tensor, m: int
) -> torch.Tensor:
    """`pair_moments` of the reference's halves, with the balance weights of an m-token
    sample of an M-token GEMM (`extrapolate_sums`)."""
    return pair_moments(*ref_halves, (weights / (m_total / m)).pow(2))


def pair_moments(t_a: torch.Tensor, t_b: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Over the output entries of a sum split in halves T = T_A + T_B: sum of w2 T^2, of
    w2 T_A T_B and of w2^2 Var(T_A T_B), then the same three unweighted.

    Var(T_A T_B) of one entry, for halves of mean mu and variance v each, is 2 mu^2 v + v^2;
    (T_A - T_B)^2 / 2 estimates v free of the mean, and T_A T_B estimates mu^2. (The plain
    square (T_A T_B)^2 would count mu^4 as spread: where a few entries carry a strong
    coherent gradient, the very case worth extrapolating, it hid the pair term.)"""
    own, pairs = (t_a + t_b).square(), t_a * t_b
    v = (t_a - t_b).square() / 2
    # v^2 / 3: the square of a one-degree chi-square estimate is 3x the square it estimates.
    spread = 2 * pairs.clamp(min=0) * v + v.square() / 3
    weighted = w2 * pairs
    return torch.stack([(w2 * own).sum(), weighted.sum(), (w2.square() * spread).sum(),
                        own.sum(), pairs.sum(), spread.sum()])  # fmt: skip


def pass_error_sums(
    ops: PassOperands,
    recipes: Sequence[Recipe],
    *,
    out_dtype: torch.dtype,
    real_fp8: bool = False,
) -> tuple[torch.Tensor, list[bool]]:
    """Error sums `[1 + len(recipes), N_SUMS]` (row 0: the bf16 GEMM) and, per recipe,
    whether FP8 was emulated (False: it ran on FP8 tensor cores).

    With `ops.m_total` above the sampled tokens (wgrad), the sums are the M-token GEMM's,
    estimated from two halves of the sample (`extrapolate_sums`).
    A delayed recipe whose history is missing gets NaN sums (no measurement).
    """
    m = ops.a.shape[1]
    sampled = ops.m_total is not None and m >= 4 and exceeds(ops.m_total, m)
    parts = halves_on(m, ops.a.device) if sampled else (None,)

    def columns(t: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
        if part is None:
            return t
        # Row and tensor scales broadcast over the columns; expanded block scales are sliced.
        return t.index_select(1, part) if t.shape[1] == m else t

    refs = [columns(ops.a, p).double() @ columns(ops.b, p).double().T for p in parts]
    b_inverse_norms = inverse_row_norms(ops.b)  # the balance weights' columns, once
    weights = inverse_row_norms(ops.a)[:, None] * b_inverse_norms[None, :]
    summed = None
    if ops.summed_total is not None:
        total = ops.summed_total
        summed = (b_inverse_norms, total if exceeds(total, ops.a.shape[0]) else ops.a.shape[0])

    # The reference's own sums are the same for every row (bf16 and each recipe): once.
    if sampled:
        reference = reference_moments(refs, weights, ops.m_total, m)
    else:
        reference = reference_sums(refs[0], weights, ops.token_rows, summed)

    def sums(halves: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Error sums from each part's (GEMM output, exact product of its operands)."""
        if not sampled:
            return error_sums(
                halves[0][0], refs[0], weights, ops.token_rows, summed, reference=reference
            )
        outs, exacts = ([h[i] for h in halves] for i in (0, 1))
        sizes = (len(parts[0]), len(parts[1]))
        return extrapolate_sums(
            outs, exacts, refs, weights, ops.m_total, sizes, ref_moments=reference
        )

    def bf16_halves() -> list[tuple[torch.Tensor, torch.Tensor]]:
        if ops.a.dtype == ops.b.dtype == torch.bfloat16:  # autocast: the reference already is
            return [(ref.bfloat16(), ref) for ref in refs]
        out = []
        for p in parts:
            a, b = columns(ops.a, p).bfloat16().double(), columns(ops.b, p).bfloat16().double()
            exact = a @ b.T
            out.append((exact.bfloat16(), exact))
        return out

    rows = [sums(bf16_halves())]
    emulated: list[bool] = []
    quantized = _Quantized(ops)
    for recipe in recipes:
        history = recipe.history if recipe.scaling == "delayed" else 0
        if (history and history not in ops.history) or (recipe.center and not ops.token_rows):
            rows.append(missing_sums(refs[0]))
            emulated.append(True)
            continue
        if recipe.center:
            b = quantized.get("b", recipe, 0)  # the second operand as the recipe without center
            rows.append(sums([centered_output(ops, recipe, b, out_dtype)]))
            emulated.append(True)
            continue
        a_q, a_scale = quantized.get("a", recipe, history)
        b_q, b_scale = quantized.get("b", recipe, history)
        halves: list[tuple[torch.Tensor, torch.Tensor]] = []
        emulated.append(False)
        for p in parts:
            out = None
            if real_fp8:
                qa, sa, qb, sb = (columns(t, p) for t in (a_q, a_scale, b_q, b_scale))
                out = scaled_mm(qa, sa, qb, sb, recipe.granularity, out_dtype)
            exact = None
            if out is None or sampled:  # the sampled estimate needs the operands' own product
                a_values, b_values = (quantized.values(x, recipe, history) for x in "ab")
                exact = columns(a_values, p) @ columns(b_values, p).T
            if out is None:
                emulated[-1] = True
                out = exact.to(out_dtype)
            halves.append((out, exact))
        rows.append(sums(halves))
    return torch.stack(rows), emulated


def centered_output(
    ops: PassOperands,
    recipe: Recipe,
    b_quantized: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, exact product) of a ``center`` recipe (a token-row pass, not sampled): the
    first operand's column means over the tokens taken out, the rest quantized with scales
    of its own, and the means' product with the unquantized second operand added back.
    Emulated (`_scaled_mm` adds no such term; its accumulation matches emulation within
    3%, `test_real_fp8_gemm_matches_emulation`)."""
    a = ops.a.float()
    mean = a.mean(dim=0, keepdim=True)
    a_q, a_scale = quantize_operand(a - mean, recipe.operand("a", ops.a_weight))
    exact = dequantize(a_q, a_scale).double() @ dequantize(*b_quantized).double().T
    exact = exact + mean.double() @ ops.b.double().T
    return exact.to(out_dtype), exact


class RelativeErrors(NamedTuple):
    balanced: torch.Tensor
    frobenius: torch.Tensor
    varying: torch.Tensor
    summed: torch.Tensor


def relative_errors(sums: torch.Tensor) -> RelativeErrors:
    """The relative errors from error sums `[..., N_SUMS]`."""
    return RelativeErrors(
        *((sums[..., num] / sums[..., den]).sqrt() for num, den in (
            (BAL_NUM, BAL_DEN), (ERR_SQ, REF_SQ), (VAR_NUM, VAR_DEN), (SUM_NUM, SUM_DEN)
        ))
    )  # fmt: skip
