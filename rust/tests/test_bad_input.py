"""Bad input gets a clear error and leaves the sketch as it was; empty input is a no-op."""

import threading

import numpy as np
import pytest

from loka.stats import Sketch, fp8_dequantize, fp8_quantize, fp8_roundtrip


@pytest.fixture
def sketch() -> Sketch:
    s = Sketch()
    s.update(np.linspace(-3, 3, 1000, dtype=np.float32))
    return s


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.update(np.ones(4, np.float64)), TypeError, "got dtype float64.*astype"),
        (lambda s: s.update(np.ones(4, np.int32)), TypeError, "float32 or float16"),
        (lambda s: s.update(np.ones(4, np.uint16)), TypeError, "bf16=True"),
        (lambda s: s.update(np.ones(4, np.float32), bf16=True), TypeError, "uint16 or int16"),
        (lambda s: s.update([1.0, 2.0]), TypeError, "numpy.ndarray, got list"),
        (lambda s: s.update(np.ones((8, 8), np.float32)[:, ::2]), ValueError, "not contiguous"),
        (lambda s: s.update_rows(np.ones((2, 3, 4), np.float32)), ValueError, "2-D.*3-D"),
        (lambda s: s.update_rows(np.ones(5, np.float32)), ValueError, "2-D.*1-D"),
        (lambda s: s.update_rows(np.ones((4, 4), np.float32).T), ValueError, "C-contiguous"),
        (lambda s: s.update_rows(np.ones((4, 4), np.float32), block=0), ValueError, "block"),
        (lambda s: s.quantile(1.5), ValueError, "outside"),
        (lambda s: s.quantiles([0.5, float("nan")]), ValueError, "outside"),
        (lambda s: s.range_fit("e3m4", 1.0), ValueError, "unknown FP8 format"),
        (lambda s: s.range_fit("e4m3", 0.0), ValueError, "scale"),
        (lambda s: s.range_fit("e4m3", float("inf")), ValueError, "scale"),
        (lambda s: s.range_fit("e4m3", 1e300), ValueError, "scale"),
        (lambda s: s.optimal_scale("fp8"), ValueError, "unknown FP8 format"),
        (lambda s: s.merge(Sketch(mantissa_bits=9)), ValueError, "resolution"),
    ],
)
def test_clear_errors_and_nothing_changes(sketch, call, error, match):
    before = sketch.to_bytes()
    with pytest.raises(error, match=match):
        call(sketch)
    assert sketch.to_bytes() == before


def test_resolution_must_be_in_range():
    for bits in (2, 11, -1):
        with pytest.raises(ValueError, match="mantissa_bits must be in"):
            Sketch(mantissa_bits=bits)


def test_empty_input_is_a_no_op(sketch):
    before = sketch.to_bytes()
    sketch.update(np.array([], np.float32))
    sketch.update(np.zeros((0, 7), np.float16))
    sketch.update_rows(np.zeros((0, 128), np.float32))
    sketch.update_rows(np.zeros((5, 0), np.float32))
    assert sketch.to_bytes() == before
    assert sketch.row_amax is None


def test_empty_sketch_answers():
    s = Sketch()
    with pytest.raises(ValueError, match="no finite values"):
        s.quantile(0.5)
    summary = s.summary()
    assert summary["count"] == 0 and np.isnan(summary["p50"]) and summary["amax"] == 0.0
    s.update(np.array([np.nan, np.inf], np.float32))
    with pytest.raises(ValueError, match="no finite values"):
        s.quantiles([0.5])


def test_readonly_and_fortran_inputs_are_accepted():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    x.flags.writeable = False
    s = Sketch()
    s.update(x)
    s.update(np.asfortranarray(x))
    s.update_rows(x)
    assert s.count == 36


def test_fp8_functions_reject_bad_input():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="float32"):
        fp8_quantize(x.astype(np.float64), "e4m3")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8_roundtrip(x, "E4M3")
    with pytest.raises(ValueError, match="scale"):
        fp8_quantize(x, "e4m3", scale=-1.0)
    with pytest.raises(TypeError, match="uint8"):
        fp8_dequantize(x, "e5m2")
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        fp8_quantize(1.0, "e4m3")


def test_concurrent_updates_from_threads():
    # The GIL is released while counting; each thread's scratch counters are its own.
    x = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)
    sketches = [Sketch() for _ in range(2)]
    threads = [threading.Thread(target=s.update, args=(x,)) for s in sketches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sketches[0].to_bytes() == sketches[1].to_bytes()
