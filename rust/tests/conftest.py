"""Shared inputs for the loka.stats tests: the distributions named in issue 2."""

import zlib
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

N = 200_000


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, round-to-nearest-even like torch."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(x)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _signed(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return np.where(rng.random(x.shape) < 0.5, -x, x)


def _subnormal_heavy(rng: np.random.Generator, n: int) -> np.ndarray:
    sub = rng.integers(1, 0x80_0000, n, dtype=np.uint32).view(np.float32)
    tiny = rng.standard_normal(n).astype(np.float32) * np.float32(1e-37)
    x = np.where(rng.random(n) < 0.6, sub, tiny)
    x[rng.random(n) < 0.05] = 0.0
    return _signed(rng, x)


def _nan_inf_laced(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    u = rng.random(n)
    x[u < 0.01] = np.nan
    x[(u >= 0.01) & (u < 0.015)] = np.inf
    x[(u >= 0.015) & (u < 0.02)] = -np.inf
    return x


def _outliers(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal(n)
    x[rng.random(n) < 1e-4] *= 1000.0
    return x


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "lognormal_sigma3": lambda rng, n: _signed(rng, rng.lognormal(0.0, 3.0, n)),
    "student_t_1.5": lambda rng, n: rng.standard_t(1.5, n),
    "outliers_1e-4_x1000": _outliers,
    "subnormal_heavy": _subnormal_heavy,
    "constant": lambda rng, n: np.full(n, 3.14159),
    "all_zero": lambda rng, n: _signed(rng, np.zeros(n)),
    "nan_inf_laced": _nan_inf_laced,
}


def make_distribution(name: str, n: int = N) -> np.ndarray:
    """float32 values of a named distribution, the same on every run."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    with np.errstate(over="ignore"):
        return DISTRIBUTIONS[name](rng, n).astype(np.float32)


@pytest.fixture(params=sorted(DISTRIBUTIONS))
def distribution(request: pytest.FixtureRequest) -> tuple[str, np.ndarray]:
    """(name, float32 values) for each named distribution."""
    return request.param, make_distribution(request.param)


@pytest.fixture
def distributions() -> Callable[..., np.ndarray]:
    """`distributions(name, n=N)`: the values of one named distribution."""
    return make_distribution


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def bf16() -> SimpleNamespace:
    """`bf16.to_bits(float32 array)` and `bf16.from_bits(uint16 array)`."""
    return SimpleNamespace(to_bits=to_bf16_bits, from_bits=from_bf16_bits)


def _to_float16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond 65504 becomes inf, as in any float16 cast
        return x.astype(np.float16)


@pytest.fixture
def to_float16() -> Callable[[np.ndarray], np.ndarray]:
    return _to_float16
