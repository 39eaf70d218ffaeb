"""Exact counters, moments, the exponent histogram, row distributions, merge."""

import numpy as np
import pytest

from loka.stats import Sketch


def expected_counts(x: np.ndarray, subnormal_below: float) -> dict[str, float]:
    finite = x[np.isfinite(x)].astype(np.float64)
    a = np.abs(finite)
    return {
        "count": x.size,
        "finite": finite.size,
        "zeros": int((a == 0).sum()),
        "subnormals": int(((a > 0) & (a < subnormal_below)).sum()),
        "nan": int(np.isnan(x).sum()),
        "pos_inf": int((x == np.inf).sum()),
        "neg_inf": int((x == -np.inf).sum()),
        "amax": float(a.max()) if a.size else 0.0,
    }


def check_against_numpy(s: Sketch, x: np.ndarray, subnormal_below: float) -> None:
    summary = s.summary()
    for key, want in expected_counts(x, subnormal_below).items():
        assert summary[key] == want, key
    finite = x[np.isfinite(x)].astype(np.float64)
    if finite.size:
        assert s.min == finite.min() and s.max == finite.max()
        scale = np.sqrt(np.sum(finite**2) * finite.size) + 1e-300
        assert abs(s.sum - finite.sum()) <= 1e-12 * scale
        assert s.sum_sq == pytest.approx(np.sum(finite**2), rel=1e-12, abs=1e-300)
        assert s.mean == pytest.approx(s.sum / finite.size)
        assert s.rms == pytest.approx(np.sqrt(np.mean(finite**2)), rel=1e-12, abs=1e-300)
    else:
        assert np.isnan(s.min) and np.isnan(s.max)


def test_counts_float32(distribution):
    _, x = distribution
    s = Sketch()
    s.update(x)
    check_against_numpy(s, x, 2.0**-126)


def test_counts_float16(distribution, to_float16):
    h = to_float16(distribution[1])
    s = Sketch()
    s.update(h)
    check_against_numpy(s, h, 2.0**-14)


def test_counts_bfloat16(distribution, bf16):
    _, x = distribution
    bits = bf16.to_bits(x)
    s = Sketch()
    s.update(bits, bf16=True)
    check_against_numpy(s, bf16.from_bits(bits), 2.0**-126)


def test_any_shape_and_fortran_order_give_the_same_sketch(rng):
    x = rng.standard_normal((64, 33)).astype(np.float32)
    flat = Sketch()
    flat.update(x.ravel())
    for variant in [x, np.asfortranarray(x), x.reshape(4, 16, 33), x[None]]:
        s = Sketch()
        s.update(variant)
        assert s.quantiles([0.1, 0.5, 0.9]) == flat.quantiles([0.1, 0.5, 0.9])
        assert s.count == flat.count


def test_exponent_histogram_is_exact(distribution):
    _, x = distribution
    s = Sketch()
    s.update(x)
    a = np.abs(x[np.isfinite(x)]).astype(np.float64)
    a = a[a > 0]
    _, exponents = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    keys, counts = np.unique(exponents - 1, return_counts=True)
    assert s.exponent_histogram() == dict(zip(keys.tolist(), counts.tolist(), strict=True))


def test_update_rows_distributions(rng):
    rows, cols, block = 96, 300, 128  # a partial last tile of 44 columns
    x = (rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, 1)))).astype(
        np.float32
    )
    x[3, 5] = np.nan
    x[7] = 0.0  # an all-zero row: its normalized values stay 0
    s = Sketch()
    s.update_rows(x, block=block)
    assert s.block == block and s.count == x.size
    a = np.abs(np.where(np.isfinite(x), x, 0.0))
    row_amax = a.max(axis=1)
    tiles = [a[:, i : i + block] for i in range(0, cols, block)]
    block_amax = np.concatenate([t.max(axis=1) for t in tiles])
    assert s.row_amax.count == rows and s.block_amax.count == rows * len(tiles)
    assert s.row_amax.max == row_amax.max() and s.row_amax.zeros == 1
    assert s.block_amax.min == block_amax.min()
    np.testing.assert_allclose(
        s.row_amax.quantiles([0.1, 0.5, 0.9]),
        np.quantile(row_amax, [0.1, 0.5, 0.9]),
        rtol=s.relative_error,
    )
    row_norm = np.abs(x) / np.where(row_amax > 0, row_amax, 1.0)[:, None]
    assert s.row_normalized.nan == 1 and s.row_normalized.max == 1.0
    assert s.row_normalized.sum == pytest.approx(np.nansum(row_norm.astype(np.float32)), rel=1e-9)
    with np.errstate(invalid="ignore"):  # the all-zero row divides 0 by 0
        block_norm = np.concatenate(
            [
                np.abs(x[:, i : i + block]) / t.max(axis=1, keepdims=True)
                for i, t in zip(range(0, cols, block), tiles, strict=True)
            ],
            axis=1,
        )
    block_norm[7] = 0.0
    np.testing.assert_allclose(
        s.block_normalized.quantiles([0.5, 0.99]),
        np.nanquantile(block_norm, [0.5, 0.99]),
        rtol=s.relative_error,
    )


def test_row_distributions_absent_until_update_rows():
    s = Sketch()
    s.update(np.ones(10, np.float32))
    assert s.row_amax is None and s.block is None and s.block_normalized is None


def test_update_rows_float16_and_bf16_match_float32(rng, bf16):
    x = rng.standard_normal((40, 256)).astype(np.float16)
    a, b = Sketch(), Sketch()
    a.update_rows(x)
    b.update_rows(x.astype(np.float32))
    assert a.row_normalized.to_bytes() == b.row_normalized.to_bytes()
    assert a.subnormals == (np.abs(x) < 2**-14).sum() - (x == 0).sum()
    bits = bf16.to_bits(rng.standard_normal((40, 256)).astype(np.float32)).reshape(40, 256)
    c, d = Sketch(), Sketch()
    c.update_rows(bits, bf16=True)
    d.update_rows(bf16.from_bits(bits).reshape(40, 256))
    assert c.to_bytes() == d.to_bytes()


def test_merge_equals_the_sketch_of_the_union(distribution):
    _, x = distribution
    cut = len(x) // 3
    whole, a, b = Sketch(), Sketch(), Sketch()
    whole.update(x)
    a.update(x[:cut])
    b.update(x[cut:])
    for merged in (Sketch.merged(a, b), a + b):
        for key, value in whole.summary().items():
            if key in ("mean", "rms"):
                assert merged.summary()[key] == pytest.approx(value, rel=1e-9, nan_ok=True)
            else:
                assert merged.summary()[key] == value or (
                    np.isnan(value) and np.isnan(merged.summary()[key])
                ), key
        assert merged.exponent_histogram() == whole.exponent_histogram()
    a.merge(b)
    assert a.count == whole.count


def test_merge_of_row_distributions(rng):
    x = rng.standard_normal((50, 256)).astype(np.float32)
    whole, top, bottom = Sketch(), Sketch(), Sketch()
    whole.update_rows(x, block=64)
    top.update_rows(x[:20], block=64)
    bottom.update_rows(x[20:], block=64)
    top.merge(bottom)
    assert top.row_amax.exponent_histogram() == whole.row_amax.exponent_histogram()
    assert top.block_normalized.quantiles([0.5]) == whole.block_normalized.quantiles([0.5])
    plain = Sketch()
    plain.update(x[:5])
    plain.merge(whole)  # a sketch without row distributions takes the other's
    assert plain.block == 64


def test_merge_with_itself_doubles(rng):
    s = Sketch()
    s.update_rows(rng.standard_normal((8, 300)).astype(np.float32))
    twice = Sketch.merged(s, s)
    s.merge(s)
    assert s.to_bytes() == twice.to_bytes()
    assert s.count == 2 * 8 * 300 and s.row_amax.count == 16


def test_merge_refuses_mismatches():
    a, b = Sketch(7), Sketch(8)
    with pytest.raises(ValueError, match="mantissa_bits 7 and 8"):
        a.merge(b)
    c, d = Sketch(), Sketch()
    c.update_rows(np.ones((2, 4), np.float32), block=2)
    d.update_rows(np.ones((2, 4), np.float32), block=4)
    with pytest.raises(ValueError, match="block widths"):
        c.merge(d)
    with pytest.raises(ValueError, match="block=2"):
        c.update_rows(np.ones((2, 4), np.float32), block=4)
    assert c.count == 8


def test_large_update_crosses_many_chunks(rng):
    x = rng.standard_normal(3_000_001).astype(np.float32)
    s = Sketch()
    s.update(x)
    assert s.count == x.size
    np.testing.assert_allclose(
        s.quantiles([0.5, 0.999]), np.quantile(np.abs(x), [0.5, 0.999]), rtol=s.relative_error
    )
