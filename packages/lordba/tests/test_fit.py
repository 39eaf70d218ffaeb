"""LoRDBA initialization from a LoRA: exactness at zero residual, error tracking the ratio."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math

import pytest
import torch
from scipy.stats import spearmanr

from loka.lordba import fit_lora


def _factor(rows, cols, noise, gen, column_profile=True):
    """Signs times a positive rank-one magnitude (constant along rows without a column
    profile), plus ``noise`` of relative magnitude noise."""
    signs = torch.randint(0, 2, (rows, cols), generator=gen) * 2.0 - 1.0
    columns = torch.rand(cols, generator=gen) + 0.5 if column_profile else torch.ones(cols)
    magnitude = torch.outer(torch.rand(rows, generator=gen) + 0.5, columns)
    wobble = (1 + noise * torch.randn(rows, cols, generator=gen)).clamp_min(0)
    return signs * magnitude * wobble


def _dense(fit):
    right = torch.where(fit.latent_a < 0, -1.0, 1.0)
    if fit.scale_in is not None:
        right = right * fit.scale_in
    left = fit.scale_out[:, None] * torch.where(fit.latent_b < 0, -1.0, 1.0) * fit.scale_rank
    return left @ right


def test_rank_one_magnitudes_reproduce_the_lora_exactly():
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b = _factor(8, 48, 0.0, gen), _factor(40, 8, 0.0, gen)
    fit = fit_lora(lora_a, lora_b, scaling=0.5, input_scale=True)
    assert fit.residual_ratio_a < 1e-6 and fit.residual_ratio_b < 1e-6
    assert fit.reconstruction_error < 1e-6
    torch.testing.assert_close(_dense(fit), 0.5 * lora_b @ lora_a, rtol=1e-5, atol=1e-6)
    # Perron-Frobenius: the fitted magnitudes are nonnegative; balancing equalizes their RMS.
    scales = [fit.scale_in, fit.scale_rank, fit.scale_out]
    assert all(bool((s >= 0).all()) for s in scales)
    rms = [float(s.square().mean().sqrt()) for s in scales]
    assert max(rms) / min(rms) == pytest.approx(1.0, rel=1e-5)


def test_default_has_no_input_scale_and_is_exact_only_for_row_constant_magnitudes():
    gen = torch.Generator().manual_seed(1)
    lora_a = _factor(4, 24, 0.0, gen, column_profile=False)  # |A| constant along each row
    lora_b = _factor(12, 4, 0.0, gen)
    fit = fit_lora(lora_a, lora_b, scaling=3.0)
    assert fit.scale_in is None
    assert fit.residual_ratio_a < 1e-6 and fit.reconstruction_error < 1e-6
    torch.testing.assert_close(_dense(fit), 3.0 * lora_b @ lora_a, rtol=1e-5, atol=1e-6)
    # A column profile only q can represent: the default fit misses it, the fit with q does not.
    profiled = _factor(4, 24, 0.0, gen)
    assert fit_lora(profiled, lora_b).residual_ratio_a > 0.05
    assert fit_lora(profiled, lora_b, input_scale=True).reconstruction_error < 1e-6


@pytest.mark.parametrize("input_scale", [True, False])
def test_reconstruction_error_tracks_the_residual_ratio(input_scale):
    gen = torch.Generator().manual_seed(2)
    ratios, errors = [], []
    for noise in [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8]:
        lora_a = _factor(16, 96, noise, gen, column_profile=input_scale)
        fit = fit_lora(lora_a, _factor(80, 16, noise, gen), 2.0, input_scale=input_scale)
        ratios.append(math.hypot(fit.residual_ratio_a, fit.residual_ratio_b))
        errors.append(fit.reconstruction_error)
        assert fit.reconstruction_error <= fit.error_bound + 1e-9
        if noise > 0:
            assert 0.5 < fit.reconstruction_error / fit.predicted_error < 2.0
    assert errors[0] < 1e-6
    assert spearmanr(ratios, errors).statistic > 0.95
    assert errors[-1] > 10 * errors[1]


def test_a_factor_fit_error_is_its_residual_ratio():
    gen = torch.Generator().manual_seed(3)
    lora_a = torch.randn(6, 30, generator=gen)
    hadamard = torch.ones(1, 1)
    for _ in range(4):
        hadamard = torch.kron(hadamard, torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    # Orthogonal columns of equal norm and constant |B|: B is fitted exactly and preserves
    # norms, so the update's error is A's error.
    lora_b = 0.3 * hadamard[:, :6]
    fit = fit_lora(lora_a, lora_b)
    assert fit.residual_ratio_b == pytest.approx(0.0, abs=1e-9)
    assert fit.reconstruction_error == pytest.approx(fit.residual_ratio_a, rel=1e-6)


def test_untrained_lora_gives_zero_update_and_live_rank_scale():
    gen = torch.Generator().manual_seed(4)
    fit = fit_lora(torch.randn(4, 16, generator=gen), torch.zeros(8, 4))
    assert torch.count_nonzero(fit.scale_out) == 0
    assert bool((fit.scale_rank > 0).all())
    assert fit.reconstruction_error == 0.0


def test_bad_lora_factors_are_named():
    a, b = torch.randn(4, 16), torch.randn(8, 4)
    with pytest.raises(ValueError, match="rank mismatch"):
        fit_lora(a, torch.randn(8, 5))
    with pytest.raises(ValueError, match="lora_a must be 2-D"):
        fit_lora(a[0], b)
    with pytest.raises(TypeError, match="lora_b must be floating point"):
        fit_lora(a, b.to(torch.int64))
    bad = a.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="lora_a contains NaN"):
        fit_lora(bad, b)
