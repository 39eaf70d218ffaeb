"""FP8 range fit: exact fractions at power-of-two scales, predicted error vs measured."""

import numpy as np
import pytest

from loka.stats import FP8_FORMATS, Sketch, fp8_quantize, fp8_roundtrip


def brute_force(x: np.ndarray, fmt: str, scale: float) -> dict[str, int]:
    """Count by the definitions: y = fl32(x * scale), q its FP8 code."""
    spec = FP8_FORMATS[fmt]
    x = x[np.isfinite(x)]
    y = x * np.float32(scale)
    magnitude = fp8_quantize(x, fmt, scale) & 0x7F
    return {
        "saturated": int((np.abs(y) > spec.max).sum()),
        "underflow": int(((x != 0) & (magnitude == 0)).sum()),
        "subnormal": int(((magnitude != 0) & ((magnitude >> spec.mantissa_bits) == 0)).sum()),
    }


def measured_rel_error(x: np.ndarray, fmt: str, scale: float) -> float:
    x = x[np.isfinite(x)].astype(np.float32)
    err = fp8_roundtrip(x, fmt, scale).astype(np.float64) - x
    return float(np.sqrt(np.sum(err**2) / np.sum(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fractions_equal_brute_force_at_powers_of_two(distribution, fmt):
    name, x = distribution
    s = Sketch()
    s.update(x)
    if s.finite == 0:
        return
    amax_exponent = int(np.floor(np.log2(s.amax))) if s.amax > 0 else 0
    for k in range(-amax_exponent - 40, -amax_exponent + 30, 3):
        scale = 2.0**k
        if not 2.0**-126 <= scale < 2.0**128:
            continue
        fit = s.range_fit(fmt, scale)
        want = brute_force(x, fmt, scale)
        for key, count in want.items():
            assert getattr(fit, key) * s.finite == pytest.approx(count, abs=1e-6), (name, k, key)


def straddling_count(x: np.ndarray, threshold: float, mantissa_bits: int = 7) -> int:
    """Values in the sketch bucket that contains `threshold` (a bucket spans 2^-m relative)."""
    step = 2.0 ** (np.floor(np.log2(threshold)) - mantissa_bits)
    lo = np.floor(threshold / step) * step
    a = np.abs(x[np.isfinite(x)]).astype(np.float64)
    return int(((a >= lo) & (a < lo + step)).sum())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("factor", [1.0, 0.37, 5.1])
def test_fractions_off_powers_of_two(distribution, fmt, factor):
    """At other scales a count is off by at most the values of the bucket a threshold cuts."""
    _, x = distribution
    s = Sketch()
    s.update(x)
    spec = FP8_FORMATS[fmt]
    scale = spec.max / s.amax * factor if s.amax > 0 else 1.0
    if scale > float(np.finfo(np.float32).max):
        return  # subnormal-only data: the dynamic scale is not a float32
    fit = s.range_fit(fmt, float(scale))
    want = brute_force(x, fmt, float(scale))
    half_subnormal = spec.min_subnormal / 2
    thresholds = {
        "saturated": [spec.max],
        "underflow": [half_subnormal],
        "subnormal": [half_subnormal, spec.min_normal - half_subnormal],
    }
    for key, ts in thresholds.items():
        slack = sum(straddling_count(x, t / float(scale)) for t in ts)
        assert abs(getattr(fit, key) * s.finite - want[key]) <= slack + 1e-6, key
    if factor == 1.0:
        assert fit.saturated * s.finite <= want["saturated"]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "name", ["normal", "lognormal_sigma3", "outliers_1e-4_x1000", "student_t_1.5"]
)
def test_predicted_error_matches_measured(distributions, name, fmt):
    x = distributions(name)
    s = Sketch()
    s.update(x)
    spec = FP8_FORMATS[fmt]
    dynamic = spec.max / s.amax
    pow2_scale, _ = s.optimal_scale(fmt, pow2=True)
    best_scale, _ = s.optimal_scale(fmt)
    for scale in [dynamic, dynamic * 7.3, dynamic / 13.0, pow2_scale, best_scale]:
        predicted = s.range_fit(fmt, scale).predicted_rel_error
        measured = measured_rel_error(x, fmt, scale)
        assert predicted == pytest.approx(measured, rel=0.05), (name, scale)


def test_bf16_data_is_predicted_exactly(bf16, rng):
    bits = bf16.to_bits(rng.standard_normal(100_000).astype(np.float32) * 3)
    x = bf16.from_bits(bits)
    s = Sketch()
    s.update(bits, bf16=True)
    for scale in [1.0, 37.0, 448 / s.amax]:
        assert s.range_fit("e4m3", scale).predicted_rel_error == pytest.approx(
            measured_rel_error(x, "e4m3", scale), rel=1e-9
        )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_optimal_scale_is_no_worse_than_alternatives(fmt, rng):
    x = (rng.standard_t(3, 100_000)).astype(np.float32)
    s = Sketch()
    s.update(x)
    dynamic = FP8_FORMATS[fmt].max / s.amax
    p2, p2_fit = s.optimal_scale(fmt, pow2=True)
    best, best_fit = s.optimal_scale(fmt)
    assert np.log2(p2) == np.round(np.log2(p2))
    assert p2_fit.scale == p2 and best_fit.scale == best
    assert best_fit.predicted_rel_error <= p2_fit.predicted_rel_error
    assert best_fit.predicted_rel_error <= s.range_fit(fmt, dynamic).predicted_rel_error
    for k in range(-4, 5):
        assert p2_fit.predicted_rel_error <= s.range_fit(fmt, p2 * 2.0**k).predicted_rel_error


def test_rowwise_fit_from_row_normalized_values(rng):
    # Rows of very different magnitude: rowwise scaling fits far better than tensorwise.
    magnitudes = 10.0 ** rng.uniform(-4, 2, (256, 1))
    x = (rng.standard_normal((256, 512)) * magnitudes).astype(np.float32)
    s = Sketch()
    s.update_rows(x, block=128)
    tensorwise = s.range_fit("e4m3", 448 / s.amax)
    rowwise = s.row_normalized.range_fit("e4m3", 448.0)
    assert tensorwise.underflow > 0.05 and rowwise.underflow < 1e-3
    # Rowwise dynamic quantization, measured. Normalized values weight every row alike, so
    # the sketch predicts the error of x / row_amax, the rows' errors pooled that way.
    row_amax = np.abs(x).max(axis=1)
    err_sq = norm_sq = 0.0
    for row, amax in zip(x, row_amax, strict=True):
        diff = fp8_roundtrip(row, "e4m3", float(np.float32(448.0) / amax)) - row
        err_sq += np.sum((diff.astype(np.float64) / amax) ** 2)
        norm_sq += np.sum((row.astype(np.float64) / amax) ** 2)
    assert rowwise.predicted_rel_error == pytest.approx(np.sqrt(err_sq / norm_sq), rel=0.05)


def test_empty_and_zero_sketches():
    s = Sketch()
    assert np.isnan(s.range_fit("e4m3", 1.0).saturated)
    s.update(np.zeros(100, np.float32))
    fit = s.range_fit("e4m3", 1.0)
    assert (fit.saturated, fit.underflow, fit.subnormal, fit.predicted_rel_error) == (0, 0, 0, 0)
    assert s.optimal_scale("e5m2")[0] == 1.0
