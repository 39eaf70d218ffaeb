"""Quantiles of |x| stay within the documented relative error of numpy.quantile."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from loka.stats import Sketch

QS = [0.0, 1e-4, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 0.9999, 1.0]


def exact_quantiles(values: np.ndarray, qs: list[float]) -> np.ndarray:
    a = np.abs(values.astype(np.float64))
    return np.quantile(a[np.isfinite(a)], qs)


def assert_within_bound(sketch: Sketch, values: np.ndarray, qs: list[float] = QS) -> None:
    got = np.array(sketch.quantiles(qs))
    want = exact_quantiles(values, qs)
    # 1e-12: float64 rounding of the interpolation; the bound itself is exact arithmetic.
    allowed = sketch.relative_error * want * (1 + 1e-12)
    bad = np.abs(got - want) > allowed
    assert not bad.any(), f"q={np.array(qs)[bad]} got {got[bad]} want {want[bad]}"


@pytest.mark.parametrize("mantissa_bits", [3, 7, 10])
def test_float32_distributions(distribution, mantissa_bits):
    _, x = distribution
    s = Sketch(mantissa_bits)
    s.update(x)
    assert s.relative_error == 2.0 ** -(mantissa_bits + 1)
    if not np.isfinite(x).any():
        return
    assert_within_bound(s, x)
    assert s.quantile(1.0) == np.abs(x[np.isfinite(x)]).max()


def test_float16_distributions(distribution, to_float16):
    h = to_float16(distribution[1])
    s = Sketch()
    s.update(h)
    assert_within_bound(s, h)


def test_bfloat16_distributions_are_exact_at_7_bits(distribution, bf16):
    _, x = distribution
    bits = bf16.to_bits(x)
    s = Sketch(mantissa_bits=7)
    s.update(bits, bf16=True)
    values = bf16.from_bits(bits)
    # Every bfloat16 value sits on a bucket edge at 7 bits: order statistics are exact.
    got = np.array(s.quantiles(QS))
    np.testing.assert_allclose(got, exact_quantiles(values, QS), rtol=1e-12, atol=0)
    s_signed = Sketch()
    s_signed.update(bits.view(np.int16), bf16=True)
    assert s_signed.to_bytes() == s.to_bytes()


def test_one_value_and_two_values():
    s = Sketch()
    s.update(np.array([-2.5], dtype=np.float32))
    assert s.quantiles([0.0, 0.5, 1.0]) == [2.5, 2.5, 2.5]
    s.update(np.array([1.0], dtype=np.float32))
    assert s.quantile(0.5) == pytest.approx(1.75, rel=s.relative_error)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 3000),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    ),
    st.integers(3, 10),
)
def test_any_float32_array(x, mantissa_bits):
    s = Sketch(mantissa_bits)
    s.update(x)
    finite = np.isfinite(x)
    assert s.finite == finite.sum()
    if finite.any():
        assert_within_bound(s, x)
