"""Per-pass error sums: anchor values on normal data, the balanced statistic, real FP8."""

from __future__ import annotations

import pytest
import torch

from loka.probe.gemm_error import (
    BAL_DEN,
    REF_SQ,
    SUM_DEN,
    VAR_DEN,
    PassOperands,
    balance_weights,
    error_sums,
    extrapolate_sums,
    inverse_row_norms,
    pass_error_sums,
    reference_moments,
    reference_sums,
    relative_errors,
    split_halves,
)
from loka.probe.scaled_mm import has_fp8_gemm
from loka.schema import Recipe

RECIPES = [
    Recipe.parse(t)
    for t in (
        "e4m3:e4m3/tensor/dynamic",
        "e4m3:e4m3/row/dynamic",
        "e4m3:e4m3/block/dynamic",
        "e5m2:e4m3/tensor/dynamic",
    )
]


def _fwd(x: torch.Tensor, w: torch.Tensor) -> PassOperands:
    return PassOperands(x, w, False, True, x.abs().amax(), w.abs().amax())


def test_normal_data_reproduces_the_h200_anchor_errors() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).bfloat16()
    w = (torch.randn(512, 512, generator=g) / 512**0.5).bfloat16()
    sums, emulated = pass_error_sums(_fwd(x, w), RECIPES, out_dtype=torch.bfloat16)
    balanced, frob = relative_errors(sums)[:2]
    # anchors/h200_gemm_bf16_vs_fp8: bf16 about 1.7e-3, e4m3 about 3.7e-2 on normal data
    assert balanced[0] == pytest.approx(1.7e-3, rel=0.25)
    assert balanced[1:4] == pytest.approx([3.7e-2] * 3, rel=0.08)
    assert 1.4 < balanced[4] / balanced[1] < 1.8  # e5m2 gradient operand: one bit less
    assert torch.allclose(balanced, frob, rtol=0.06)  # well-conditioned: both statistics agree
    assert emulated == [True] * 4


def test_balanced_error_weighs_every_row_alike() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g)
    w = torch.randn(48, 256, generator=g) / 16
    row = [Recipe.parse("e4m3:e4m3/row/dynamic")]
    base = pass_error_sums(_fwd(x, w), row, out_dtype=torch.float32)[0]
    # Power-of-two row scales pass through rowwise FP8 exactly: the balanced error cannot
    # change, while the plain one follows whichever rows are now the largest.
    spread = torch.exp2(torch.randint(-12, 12, (64, 1), generator=g).float())
    x_spread = x * spread
    x_spread[3] = 0.0  # an all-zero row carries no weight
    scaled = pass_error_sums(_fwd(x_spread, w), row, out_dtype=torch.float32)[0]
    keep = torch.ones(64, dtype=torch.bool)
    keep[3] = False
    base_kept = pass_error_sums(_fwd(x[keep], w), row, out_dtype=torch.float32)[0]
    kept = float(relative_errors(base_kept)[0][1])
    assert float(relative_errors(scaled)[0][1]) == pytest.approx(kept, rel=1e-9)
    assert float(relative_errors(base)[0][1]) == pytest.approx(kept, rel=0.05)
    assert float(relative_errors(scaled)[1][1]) != pytest.approx(kept, rel=0.05)
    weights = balance_weights(x_spread, w)
    assert torch.all(weights[3] == 0) and weights.dtype == torch.float64


def test_grouped_gemms_combine_by_adding_sums() -> None:
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(64, 128, generator=g) for _ in range(2)]
    b = [torch.randn(32, 128, generator=g) for _ in range(2)]
    parts = [
        pass_error_sums(_fwd(x, w), RECIPES[:1], out_dtype=torch.float32)[0]
        for x, w in zip(a, b, strict=True)
    ]
    joint = relative_errors(parts[0] + parts[1])[0][1]
    each = [relative_errors(p)[0][1] for p in parts]
    assert min(each) <= joint <= max(each)


def test_delayed_recipe_without_history_is_not_measured() -> None:
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    delayed = Recipe.parse("e4m3:e4m3/tensor/delayed4")
    sums, _ = pass_error_sums(_fwd(x, w), [delayed], out_dtype=torch.float32)
    assert torch.isnan(sums[1]).all() and torch.isfinite(sums[0]).all()
    ops = _fwd(x, w)
    ops.history = {4: (x.abs().amax() / 8, w.abs().amax())}  # amax grew 8x since
    sums, _ = pass_error_sums(ops, [delayed, RECIPES[0]], out_dtype=torch.float32)
    stale, fresh = relative_errors(sums)[0][1:]
    assert stale > 5 * fresh


@pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8_gemm(torch.device("cuda"))),
    reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)",
)
def test_real_fp8_gemm_matches_emulation() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(512, 1024, device="cuda", generator=g) / 32).bfloat16()
    recipes = [*RECIPES[:2], Recipe.parse("e4m3:e4m3/tensor/dynamic/pow2")]
    real, emulated_flags = pass_error_sums(
        _fwd(x, w), recipes, out_dtype=torch.bfloat16, real_fp8=True
    )
    emulated, _ = pass_error_sums(_fwd(x, w), recipes, out_dtype=torch.bfloat16)
    assert not emulated_flags[0], "tensorwise e4m3 should run on torch._scaled_mm"
    assert torch.allclose(relative_errors(real)[0], relative_errors(emulated)[0], rtol=0.03)


def _wgrad(dy: torch.Tensor, x: torch.Tensor, m_total: int | None = None) -> PassOperands:
    """Wgrad operands in pass layout; the amaxes are those of the tensors given (callers pass
    the whole batch's when they sample)."""
    return PassOperands(
        dy.T, x.T, False, False, dy.abs().amax(), x.abs().amax(),
        a_row_amax=dy.abs().amax(dim=0), b_row_amax=x.abs().amax(dim=0), m_total=m_total,
    )  # fmt: skip


def _sampled_wgrad(dy: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> PassOperands:
    whole = _wgrad(dy, x)
    return PassOperands(
        dy[rows].T, x[rows].T, False, False, whole.a_amax, whole.b_amax,
        a_row_amax=whole.a_row_amax, b_row_amax=whole.b_row_amax, m_total=dy.shape[0],
    )  # fmt: skip


def _batch(coherent: float, M: int = 2048, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 48] and dY [M, 40]; `coherent` of dY follows x through a fixed map, so dW = dY^T x
    has a part that adds up over the tokens, and the rest is independent per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 48, generator=g)
    link = torch.randn(48, 40, generator=g) / 48**0.5
    dy = coherent * (x @ link) + torch.randn(M, 40, generator=g)
    return dy, x


ROW = [Recipe.parse("e4m3:e4m3/row/dynamic")]


@pytest.mark.parametrize("coherent", [0.0, 0.3, 2.0])
def test_sampled_wgrad_error_is_not_optimistic_on_average(coherent: float) -> None:
    """Over random samples of m of M tokens, the estimated relative error of the whole batch
    averages at or a little above the true one, whatever the gradient's coherence: the
    estimate may err on the safe side, never far below. (This output has 40 x 48 entries: the
    pair term's noise, which the estimate guards against, is far larger than a real layer's.)"""
    dy, x = _batch(coherent)
    M, m = dy.shape[0], 128
    exact = relative_errors(pass_error_sums(_wgrad(dy, x), ROW, out_dtype=torch.float32)[0])
    g = torch.Generator().manual_seed(11)
    estimates = []
    for _ in range(100):
        rows = torch.randperm(M, generator=g)[:m].sort().values
        sums = pass_error_sums(_sampled_wgrad(dy, x, rows), ROW, out_dtype=torch.float32)[0]
        estimates.append(torch.stack(relative_errors(sums))[:, 1])
    mean = torch.stack(estimates).mean(dim=0)
    for stat in (0, 1):  # balanced, plain
        assert 0.95 < mean[stat].item() / exact[stat][1].item() < 1.6


def test_sampled_wgrad_error_follows_the_whole_batch_not_the_sample() -> None:
    """Where the gradient adds up over the tokens and the errors do not, a 128-token sample's
    relative error is about sqrt(M / m) = 3x the whole batch's: the estimate is not."""
    dy, x = _batch(coherent=2.0)
    M, m = dy.shape[0], 256
    rows = torch.randperm(M, generator=torch.Generator().manual_seed(3))[:m].sort().values
    exact = relative_errors(pass_error_sums(_wgrad(dy, x), ROW, out_dtype=torch.float32)[0])
    naive_ops = _sampled_wgrad(dy, x, rows)
    naive_ops.m_total = None
    naive = relative_errors(pass_error_sums(naive_ops, ROW, out_dtype=torch.float32)[0])
    est = relative_errors(
        pass_error_sums(_sampled_wgrad(dy, x, rows), ROW, out_dtype=torch.float32)[0]
    )
    for stat in (0, 1):  # balanced, plain
        truth = exact[stat][1].item()
        assert naive[stat][1].item() > 2 * truth
        assert est[stat][1].item() == pytest.approx(truth, rel=0.3)


def test_the_outputs_own_rounding_is_carried_over_as_a_relative_error() -> None:
    """bf16 operands, bf16 output: the bf16 GEMM's only error is its output's rounding,
    relative to the output whatever M; as a sum over tokens it would read ~5x low here."""
    dy, x = _batch(coherent=2.0, M=8192)
    dy, x = dy.bfloat16(), x.bfloat16()
    rows = torch.randperm(8192, generator=torch.Generator().manual_seed(6))[:256].sort().values
    exact = pass_error_sums(_wgrad(dy, x), ROW, out_dtype=torch.bfloat16)[0]
    est = pass_error_sums(_sampled_wgrad(dy, x, rows), ROW, out_dtype=torch.bfloat16)[0]
    truth, got = relative_errors(exact)[0], relative_errors(est)[0]
    assert got[0].item() == pytest.approx(truth[0].item(), rel=0.2)  # ~1.7e-3: bf16 output
    assert got[1].item() == pytest.approx(truth[1].item(), rel=0.3)


def test_independent_tokens_keep_their_relative_error() -> None:
    """No coherent part: error and reference both grow like M, so the sample's relative
    error is already the whole batch's, and the estimate stays there."""
    dy, x = _batch(coherent=0.0)
    rows = torch.randperm(dy.shape[0], generator=torch.Generator().manual_seed(4))[:256]
    exact = relative_errors(pass_error_sums(_wgrad(dy, x), ROW, out_dtype=torch.float32)[0])
    est = relative_errors(
        pass_error_sums(_sampled_wgrad(dy, x, rows.sort().values), ROW, out_dtype=torch.float32)[0]
    )
    assert est[0][1].item() == pytest.approx(exact[0][1].item(), rel=0.25)


def test_an_unsampled_wgrad_is_measured_as_before() -> None:
    dy, x = _batch(coherent=1.0, M=96)
    plain = pass_error_sums(_wgrad(dy, x), RECIPES, out_dtype=torch.bfloat16)[0]
    told = pass_error_sums(_wgrad(dy, x, m_total=96), RECIPES, out_dtype=torch.bfloat16)[0]
    assert torch.equal(plain, told)


def test_only_the_wgrad_pass_is_told_how_many_tokens_were_sampled_from() -> None:
    from loka.probe.analyze import pass_operands
    from loka.probe.capture import GemmSample

    x, w, dy = torch.randn(64, 32), torch.randn(16, 32), torch.randn(64, 16)
    gemm = GemmSample(
        x=x, weight=w, x_amax=x.abs().amax(), x_col_amax=x.abs().amax(0),
        w_amax=w.abs().amax(), m_total=4096, rows=torch.arange(64), dy=dy,
        dy_amax=dy.abs().amax(), dy_col_amax=dy.abs().amax(0),
    )  # fmt: skip
    ops = pass_operands(gemm, {})
    assert ops["wgrad"].m_total == 4096  # the reduction ran over 4096 tokens, 64 kept
    assert ops["fwd"].m_total is None and ops["dgrad"].m_total is None  # per token: exact


def test_a_coherent_gradient_carried_by_a_few_entries_is_still_extrapolated() -> None:
    """Four output channels follow x strongly, the rest are noise: the coherent part sits in
    a few entries. Their own square, (T_A T_B)^2, once served as the pair term's spread:
    it counted the signal as noise, the pair term never cleared it, and the estimate kept
    the sample's reading (0.026 against the whole batch's 0.008)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16384, 64, generator=g)
    link = torch.zeros(64, 48)
    link[:4, :4] = 3 * torch.eye(4)
    dy = x @ link + 0.3 * torch.randn(16384, 48, generator=g)
    truth = relative_errors(pass_error_sums(_wgrad(dy, x), ROW, out_dtype=torch.float32)[0])
    estimates, samples = [], []
    for seed in range(5):
        rows = torch.randperm(16384, generator=torch.Generator().manual_seed(seed))[:1024]
        ops = _sampled_wgrad(dy, x, rows.sort().values)
        estimates.append(relative_errors(pass_error_sums(ops, ROW, out_dtype=torch.float32)[0]))
        ops.m_total = None
        samples.append(relative_errors(pass_error_sums(ops, ROW, out_dtype=torch.float32)[0]))
    mean = [sum(e[stat][1].item() for e in estimates) / 5 for stat in (0, 1)]
    sample = sum(s[0][1].item() for s in samples) / 5
    assert sample > 2.5 * truth[0][1].item()
    assert mean[0] == pytest.approx(truth[0][1].item(), rel=0.25)  # balanced: what decides
    assert 0.9 < mean[1] / truth[1][1].item() < 1.6  # plain: on the safe side


def _collapsed_states(spread: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states that are one shared vector plus a small per-token part (a model on a
    loss plateau), and a weight."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, 512, generator=g)
    x = (shared + spread * torch.randn(512, 512, generator=g)).bfloat16()
    w = (torch.randn(256, 512, generator=g) / 512**0.5).bfloat16()
    return x, w


def test_the_varying_error_sees_states_that_barely_vary_over_the_batch() -> None:
    row = [Recipe.parse("e4m3:e4m3/row/dynamic")]
    x, w = _collapsed_states(0.01)
    ops = PassOperands(x, w, False, True, x.abs().amax(), w.abs().amax(), token_rows=True)
    sums, _ = pass_error_sums(ops, row, out_dtype=torch.bfloat16)
    balanced, _, varying, _ = relative_errors(sums)
    # Overall the rowwise error is the usual few percent: within any fwd budget ...
    assert float(balanced[1]) < 0.06
    # ... but it is larger than the whole token-to-token part of the output.
    assert float(varying[1]) > 1.0
    # The bf16 GEMM loses some of it too (its output rounds the shared part), far less.
    assert float(varying[0]) < 0.2
    # States that vary about as much as they are large: the two are alike.
    x, w = _collapsed_states(1.0)
    ops = PassOperands(x, w, False, True, x.abs().amax(), w.abs().amax(), token_rows=True)
    balanced, _, varying, _ = relative_errors(pass_error_sums(ops, row, out_dtype=torch.float32)[0])
    assert float(balanced[1]) <= float(varying[1]) < 1.5 * float(balanced[1])


def test_without_token_rows_the_varying_sums_are_the_balanced_ones() -> None:
    x, w = _collapsed_states(0.003)
    sums, _ = pass_error_sums(_fwd(x, w), RECIPES[:2], out_dtype=torch.bfloat16)
    balanced, _, varying, _ = relative_errors(sums)
    assert torch.equal(balanced, varying)


def test_a_centered_recipe_keeps_what_varies_and_the_product():
    row, centered = (
        Recipe.parse(t) for t in ("e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic/center")
    )
    x, w = _collapsed_states(0.01)
    ops = PassOperands(x, w, False, True, x.abs().amax(), w.abs().amax(), token_rows=True)
    sums, emulated = pass_error_sums(ops, [row, centered], out_dtype=torch.float32)
    balanced, _, varying, _ = relative_errors(sums)
    assert float(varying[1]) > 1.0 and float(varying[2]) < 0.06  # e4m3 of what varies only
    assert float(balanced[2]) < float(balanced[1]) / 5  # and the shared part exactly
    assert emulated[1]  # always emulated: _scaled_mm adds no mean product
    # Not where the rows are not tokens (wgrad): no measurement.
    ops = PassOperands(x, w, False, True, x.abs().amax(), w.abs().amax())
    sums, _ = pass_error_sums(ops, [centered], out_dtype=torch.float32)
    assert torch.isnan(sums[1]).all() and not torch.isnan(sums[0]).any()


def _dgrad(dy: torch.Tensor, w: torch.Tensor, summed_total: int | None) -> PassOperands:
    return PassOperands(
        dy, w.T, False, True, dy.abs().amax(), w.abs().amax(), token_rows=True,
        summed_total=summed_total,
    )  # fmt: skip


def test_the_summed_error_sees_a_gradient_sum_that_fp8_drowns(plateau_gradients) -> None:
    row = [Recipe.parse("e4m3:e4m3/row/dynamic")]
    dy, w = plateau_gradients(1024)
    errors = relative_errors(pass_error_sums(_dgrad(dy, w, 1024), row, out_dtype=torch.bfloat16)[0])
    # per token and per channel, the usual few percent of rowwise e4m3 ...
    assert float(errors.balanced[1]) < 0.06 and float(errors.varying[1]) < 0.06
    # ... and more than the whole sum over the tokens, which the bf16 GEMM keeps
    assert float(errors.summed[1]) > 0.5
    assert float(errors.summed[0]) < float(errors.summed[1]) / 10
    # without a token count the summed sums repeat the balanced ones
    sums, _ = pass_error_sums(_dgrad(dy, w, None), row, out_dtype=torch.bfloat16)
    assert torch.equal(relative_errors(sums).summed, relative_errors(sums).balanced)


def test_the_summed_error_of_a_sample_estimates_the_whole_batchs(plateau_gradients) -> None:
    # The drowned part of the sum grows like M, the cancelling sum itself like sqrt(M): the
    # sample's own sum misstates the batch's, the extrapolated estimate follows it (noisily:
    # a sum has only as many entries as the output has columns, so it is judged on average).
    row = [Recipe.parse("e4m3:e4m3/row/dynamic")]
    m_total, m = 4096, 512
    dy, w = plateau_gradients(m_total)

    def summed(ops: PassOperands) -> float:
        sums, _ = pass_error_sums(ops, row, out_dtype=torch.bfloat16)
        return float(relative_errors(sums).summed[1])

    truth = summed(_dgrad(dy, w, m_total))
    estimates, own = [], []
    for seed in range(12):
        rows = torch.randperm(m_total, generator=torch.Generator().manual_seed(seed))[:m]
        sample = dy[rows.sort().values]
        estimates.append(summed(_dgrad(sample, w, m_total)))
        own.append(summed(_dgrad(sample, w, m)))
    mean = sum(estimates) / len(estimates)
    assert truth / 1.5 < mean < truth * 1.5  # 1.07 against 1.12
    assert sum(own) / len(own) < 0.6 * truth  # the sample's own sum: 0.50


def test_the_reference_is_summed_once_per_pass_with_the_same_result() -> None:
    """`pass_error_sums` takes the reference's sums once for all recipes of a pass; they
    equal the sums taken along with each output alone, sampled wgrad included."""
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(96, 40, generator=g).bfloat16()
    wt = torch.randn(48, 40, generator=g).bfloat16()
    ref = dy.double() @ wt.double().T
    weights = balance_weights(dy, wt)
    summed = (inverse_row_norms(wt), 8 * dy.shape[0])
    out = (ref + 1e-2 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).float()
    shared = reference_sums(ref, weights, True, summed)
    alone = error_sums(out, ref, weights, True, summed)
    assert torch.equal(error_sums(out, ref, weights, True, summed, reference=shared), alone)

    halves = [dy.double().index_select(0, p) for p in split_halves(96)]
    refs = [h.T @ h for h in halves]
    outs = [r + 1e-3 for r in refs]
    w = torch.ones_like(refs[0])
    sizes = (len(halves[0]), len(halves[1]))
    alone = extrapolate_sums(outs, outs, refs, w, 1024, sizes)
    moments = reference_moments(refs, w, 1024, 96)
    assert torch.equal(extrapolate_sums(outs, outs, refs, w, 1024, sizes, moments), alone)

    ops = PassOperands(dy, wt, False, True, dy.abs().amax(), wt.abs().amax(), token_rows=True,
                       summed_total=8 * dy.shape[0])  # fmt: skip
    rows = pass_error_sums(ops, RECIPES, out_dtype=torch.bfloat16)[0]
    for col in (BAL_DEN, REF_SQ, VAR_DEN, SUM_DEN):  # one reference for every row
        assert torch.equal(rows[:, col], rows[0, col].expand(len(RECIPES) + 1))
        assert rows[0, col] > 0
