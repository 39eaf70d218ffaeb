"""ErrorAccumulator against numpy, its merge, and per-row quantiles."""

import numpy as np
import pytest

from loka.stats import ErrorAccumulator, fp8_roundtrip


def batches(rng: np.random.Generator, n: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i in range(n):
        ref = rng.standard_normal((32, 64)).astype(np.float32) * (1 + i)
        out.append((ref, fp8_roundtrip(ref, "e4m3", 448 / float(np.abs(ref).max()))))
    return out


def test_totals_match_numpy(rng):
    data = batches(rng)
    acc = ErrorAccumulator()
    for ref, approx in data:
        acc.update(ref, approx)
    ref = np.concatenate([r.ravel() for r, _ in data]).astype(np.float64)
    approx = np.concatenate([a.ravel() for _, a in data]).astype(np.float64)
    err = approx - ref
    assert acc.n_batches == len(data) and acc.n_values == ref.size
    assert acc.rel_fro == pytest.approx(np.linalg.norm(err) / np.linalg.norm(ref), rel=1e-12)
    assert acc.sqnr_db == pytest.approx(10 * np.log10(np.sum(ref**2) / np.sum(err**2)), rel=1e-12)
    assert acc.max_abs == np.abs(err).max()
    per_batch = [
        np.linalg.norm(a.astype(np.float64) - r) / np.linalg.norm(r.astype(np.float64))
        for r, a in data
    ]
    assert acc.batch_mean == pytest.approx(np.mean(per_batch), rel=1e-12)
    assert acc.batch_var == pytest.approx(np.var(per_batch, ddof=1), rel=1e-9)
    assert acc.batch_std == pytest.approx(np.std(per_batch, ddof=1), rel=1e-9)
    rows = np.concatenate(
        [
            np.linalg.norm(a.astype(np.float64) - r, axis=1)
            / np.linalg.norm(r.astype(np.float64), axis=1)
            for r, a in data
        ]
    )
    for q in [0.0, 0.5, 0.99, 1.0]:
        assert acc.row_rel_err_quantile(q) == pytest.approx(np.quantile(rows, q), rel=2**-8 + 1e-6)


def test_merge_equals_sequential(rng):
    data = batches(rng, 9)
    whole, left, right = ErrorAccumulator(), ErrorAccumulator(), ErrorAccumulator()
    for i, (ref, approx) in enumerate(data):
        whole.update(ref, approx)
        (left if i < 4 else right).update(ref, approx)
    for merged in (ErrorAccumulator.merged(left, right), left + right):
        for key, value in whole.summary().items():
            assert merged.summary()[key] == pytest.approx(value, rel=1e-12), key
    left.merge(right)
    assert left.n_batches == 9
    left.merge(left)
    assert left.n_batches == 18 and left.rel_fro == pytest.approx(whole.rel_fro, rel=1e-12)


def test_float64_batches_and_three_dimensions(rng):
    ref = rng.standard_normal((4, 8, 16))
    approx = ref + 1e-3
    acc = ErrorAccumulator()
    acc.update(ref, approx)
    assert acc.row_errors.count == 32  # rows of the last dimension
    assert acc.max_abs == pytest.approx(1e-3)


def test_one_dimensional_batches_have_no_row_errors(rng):
    acc = ErrorAccumulator()
    acc.update(np.ones(5, np.float32), np.ones(5, np.float32))
    assert acc.sqnr_db == np.inf and acc.rel_fro == 0.0
    assert np.isnan(acc.batch_var)
    with pytest.raises(ValueError, match="no per-row errors"):
        acc.row_rel_err_quantile(0.5)
    assert np.isnan(acc.summary()["row_p50"])


def test_empty_accumulator_is_nan():
    acc = ErrorAccumulator()
    s = acc.summary()
    assert s["n_batches"] == 0 and np.isnan(s["rel_fro"]) and np.isnan(s["sqnr_db"])


def test_zero_reference_rows_count_as_infinite(rng):
    ref = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]], np.float32)
    approx = np.array([[1.0, 2.0], [0.1, 0.0], [3.0, 4.4]], np.float32)
    acc = ErrorAccumulator()
    acc.update(ref, approx)
    assert acc.row_rel_err_quantile(1.0) == np.inf
    assert acc.row_rel_err_quantile(0.0) == 0.0


def test_bad_batches_change_nothing():
    acc = ErrorAccumulator()
    acc.update(np.ones(4, np.float32), np.full(4, 1.5, np.float32))
    before = acc.to_bytes()
    ones = np.ones((2, 3), np.float32)
    cases = [
        ((ones, np.ones((3, 2), np.float32)), ValueError, "shape"),
        ((ones, ones.astype(np.float64)), TypeError, "float32"),
        ((ones.astype(np.int32), ones.astype(np.int32)), TypeError, "dtypes"),
        ((np.ones(0, np.float32), np.ones(0, np.float32)), ValueError, "empty"),
        ((np.ones((3, 0), np.float32), np.ones((3, 0), np.float32)), ValueError, "empty"),
        ((ones, np.full((2, 3), np.nan, np.float32)), ValueError, "approx has 6 non-finite"),
        ((np.full((2, 3), np.inf, np.float32), ones), ValueError, "reference has 6 non-finite"),
        ((np.zeros((2, 3), np.float32), ones), ValueError, "all zeros"),
        (
            (np.ones((3, 4), np.float32)[:, ::2], np.ones((3, 2), np.float32)),
            ValueError,
            "C-contiguous",
        ),
        (([1.0], [1.0]), TypeError, "numpy.ndarray"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            acc.update(*args)
    assert acc.to_bytes() == before
