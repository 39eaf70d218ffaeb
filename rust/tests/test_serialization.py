"""Versioned, checksummed bytes and pickling; corrupt or foreign bytes raise ValueError."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loka.stats import FORMAT_VERSION, ErrorAccumulator, RangeFit, Sketch


@pytest.fixture(scope="module")
def sketch() -> Sketch:
    s = Sketch(mantissa_bits=6)
    x = np.random.default_rng(5).standard_normal((64, 200)).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, 0.0]
    s.update_rows(x, block=32)
    return s


@pytest.fixture
def accumulator(rng) -> ErrorAccumulator:
    acc = ErrorAccumulator()
    ref = rng.standard_normal((8, 16)).astype(np.float32)
    acc.update(ref, ref * 1.01)
    acc.update(ref, ref * 0.98)
    return acc


def test_sketch_round_trip(sketch):
    data = sketch.to_bytes()
    back = Sketch.from_bytes(data)
    assert back.to_bytes() == data
    assert back.summary() == pytest.approx(sketch.summary(), nan_ok=True)
    assert back.block == 32 and back.mantissa_bits == 6
    assert back.block_normalized.quantiles([0.5]) == sketch.block_normalized.quantiles([0.5])
    assert Sketch.from_bytes(bytearray(data)).to_bytes() == data
    assert data[:4] == b"LKSK" and int.from_bytes(data[4:6], "little") == FORMAT_VERSION


def test_accumulator_round_trip(accumulator):
    data = accumulator.to_bytes()
    back = ErrorAccumulator.from_bytes(data)
    assert back.to_bytes() == data
    assert back.summary() == pytest.approx(accumulator.summary())


def test_pickle_and_copy(sketch, accumulator):
    for obj in (sketch, accumulator):
        for clone in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj), copy.copy(obj)):
            assert type(clone) is type(obj) and clone.to_bytes() == obj.to_bytes()
    fit = sketch.range_fit("e4m3", 4.0)
    assert pickle.loads(pickle.dumps(fit)).to_dict() == fit.to_dict()
    assert isinstance(fit, RangeFit)


def test_every_single_byte_corruption_is_refused(accumulator):
    data = accumulator.to_bytes()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(ValueError):
            ErrorAccumulator.from_bytes(bytes(bad))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 255))
def test_sketch_corruption_is_refused(sketch, position, flip):
    data = bytearray(sketch.to_bytes())
    data[position % len(data)] ^= flip
    with pytest.raises(ValueError):
        Sketch.from_bytes(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_refused(data):
    with pytest.raises(ValueError):
        Sketch.from_bytes(data)
    with pytest.raises(ValueError):
        ErrorAccumulator.from_bytes(data)


def test_foreign_truncated_and_future_bytes(sketch, accumulator):
    with pytest.raises(ValueError, match="another loka-stats object"):
        Sketch.from_bytes(accumulator.to_bytes())
    with pytest.raises(ValueError, match="another loka-stats object"):
        ErrorAccumulator.from_bytes(sketch.to_bytes())
    data = sketch.to_bytes()
    with pytest.raises(ValueError, match="checksum"):
        Sketch.from_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError):
        Sketch.from_bytes(data[: len(data) // 2])
    future = bytearray(data)
    future[4] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=f"version {FORMAT_VERSION + 1}"):
        Sketch.from_bytes(bytes(future))
    with pytest.raises(ValueError, match="bad magic"):
        Sketch.from_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(TypeError, match="bytes"):
        Sketch.from_bytes("LKSK")  # type: ignore[arg-type]
