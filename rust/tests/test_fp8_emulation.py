"""FP8 emulation is bit-exact with torch's float8 casts of clamped values (an infinite input
becomes NaN, as the project's cast makes it: an overflow upstream stays visible)."""

import numpy as np
import pytest

from loka.stats import FP8_FORMATS, fp8_dequantize, fp8_quantize, fp8_roundtrip

torch = pytest.importorskip("torch")

TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def all_finite_codes(fmt: str) -> np.ndarray:
    values = fp8_dequantize(np.arange(256, dtype=np.uint8), fmt)
    return np.unique(values[np.isfinite(values)])


def hard_values(fmt: str, rng: np.random.Generator, n: int = 1_000_000) -> np.ndarray:
    """1e6 float32 values: every FP8 value, every tie between neighbours, subnormals of FP8
    and float32, the max and beyond, NaN, +-Inf, +-0 and random bits over the whole range."""
    grid = all_finite_codes(fmt).astype(np.float64)
    ties = (grid[:-1] + grid[1:]) / 2
    spec = FP8_FORMATS[fmt]
    special = np.array(
        [
            0.0,
            -0.0,
            np.nan,
            -np.nan,
            np.inf,
            -np.inf,
            spec.max,
            -spec.max,
            spec.max * 1.03,
            spec.max * 2,
            1e38,
            spec.min_subnormal / 2,
            spec.min_subnormal * 0.75,
            spec.min_normal,
            spec.min_normal * (1 - 2**-6),
            1e-45,
            3e-39,
        ],
    )
    near = np.concatenate([ties, grid])
    near = np.concatenate(
        [
            near,
            np.nextafter(near.astype(np.float32), np.float32(np.inf)),
            np.nextafter(near.astype(np.float32), np.float32(-np.inf)),
        ]
    )
    fixed = np.concatenate([special, near, -near]).astype(np.float32)
    random_bits = rng.integers(0, 2**32, n - fixed.size, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([fixed, random_bits.view(np.float32)])


def saturated(x: np.ndarray, fmt: str, scale: float) -> torch.Tensor:
    """``clamp(x * scale)``, with NaN where x is infinite: the values the codes encode."""
    t = torch.from_numpy(x)
    m = FP8_FORMATS[fmt].max
    y = torch.clamp(t * torch.tensor(scale, dtype=torch.float32), -m, m)
    return torch.where(t.isinf(), float("nan"), y)


def torch_codes(x: np.ndarray, fmt: str, scale: float) -> np.ndarray:
    return saturated(x, fmt, scale).to(TORCH_DTYPES[fmt]).view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.3671875, 1024.0, 3.1e-3])
def test_quantize_is_bit_exact(fmt, scale, rng):
    x = hard_values(fmt, rng)
    ours = fp8_quantize(x, fmt, scale)
    theirs = torch_codes(x, fmt, scale)
    mismatch = np.flatnonzero(ours != theirs)
    assert mismatch.size == 0, (
        f"{mismatch.size} differ, e.g. x={x[mismatch[:5]]}: {ours[mismatch[:5]]} vs {theirs[mismatch[:5]]}"
    )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_and_roundtrip_are_bit_exact(fmt, rng):
    codes = np.arange(256, dtype=np.uint8)
    scale = 0.3671875
    theirs = (torch.from_numpy(codes).view(TORCH_DTYPES[fmt]).float() / scale).numpy()
    np.testing.assert_array_equal(
        fp8_dequantize(codes, fmt, scale).view(np.uint32), theirs.view(np.uint32)
    )
    x = hard_values(fmt, rng, 200_000)
    expected = (saturated(x, fmt, scale).to(TORCH_DTYPES[fmt]).float() / scale).numpy()
    got = fp8_roundtrip(x, fmt, scale)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_shapes_and_layouts_are_kept(rng):
    x = rng.standard_normal((6, 5, 4)).astype(np.float32)
    for view in [x, x.transpose(2, 0, 1), x[:, ::2]]:
        codes = fp8_quantize(view, "e4m3", 2.0)
        assert codes.shape == view.shape and codes.dtype == np.uint8
        np.testing.assert_array_equal(codes, torch_codes(np.ascontiguousarray(view), "e4m3", 2.0))
        assert fp8_dequantize(codes, "e4m3", 2.0).shape == view.shape
    assert fp8_quantize(np.array(1.0, dtype=np.float32), "e5m2").shape == ()


def test_format_constants():
    e4m3, e5m2 = FP8_FORMATS["e4m3"], FP8_FORMATS["e5m2"]
    assert (e4m3.max, e5m2.max) == (448.0, 57344.0)
    assert e4m3.max == torch.finfo(torch.float8_e4m3fn).max
    assert e5m2.max == torch.finfo(torch.float8_e5m2).max
    assert e4m3.min_normal == torch.finfo(torch.float8_e4m3fn).tiny
    assert e5m2.min_normal == torch.finfo(torch.float8_e5m2).tiny
    assert (e4m3.min_subnormal, e5m2.min_subnormal) == (2.0**-9, 2.0**-16)
    assert (e4m3.mantissa_bits, e5m2.mantissa_bits) == (3, 2)
