import math

import numpy as np
import pytest

from loka.schema import SketchRecord, read_table, tensor_stats_from_sketches, write_table

stats = pytest.importorskip("loka.stats", reason="loka-stats (the Rust extension) is not built")


def _record(sketch, role="input", window=0):
    return SketchRecord("mlp.0", role, window, 0, 9, 3, sketch)


def test_rows_carry_sketch_statistics_and_dynamic_range_fits(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    x[:, 7] *= 300.0  # one outlier channel: tensorwise scaling squeezes every other column
    sk = stats.Sketch()
    sk.update_rows(x)
    df = tensor_stats_from_sketches([_record(sk)])
    row = df.row(0, named=True)
    assert row["count"] == x.size and row["amax"] == pytest.approx(np.abs(x).max())
    assert row["p99"] == pytest.approx(np.quantile(np.abs(x), 0.99), rel=sk.relative_error)
    assert row["row_amax_p50"] == pytest.approx(np.median(np.abs(x).max(1)), rel=0.01)
    # The outlier channel costs tensorwise scaling precision that rowwise scaling keeps.
    assert row["e4m3_tensor_underflow"] > row["e4m3_row_underflow"]
    assert row["e4m3_tensor_pred_err"] > row["e4m3_row_pred_err"]
    assert row["e4m3_tensor_saturated"] == 0.0 and row["e4m3_row_saturated"] == 0.0
    back = stats.Sketch.from_bytes(row["sketch"])
    assert back.count == sk.count and back.amax == sk.amax

    path = write_table(df, tmp_path / "tensor_stats.parquet", "tensor_stats")
    assert read_table(path, "tensor_stats").equals(df)


def test_flat_and_empty_sketches_give_nulls_not_nans():
    flat = stats.Sketch()
    flat.update(np.ones(10, dtype=np.float32))
    empty = stats.Sketch()
    df = tensor_stats_from_sketches([_record(flat), _record(empty, role="weight")])
    flat_row, empty_row = df.rows(named=True)
    assert flat_row["e4m3_row_underflow"] is None  # no row-structured data was fed
    assert flat_row["e4m3_tensor_saturated"] == 0.0
    assert empty_row["count"] == 0 and empty_row["amax"] == 0.0
    assert empty_row["p50"] is None and empty_row["e4m3_tensor_pred_err"] is None
    for value in df.select(df.columns[:-1]).row(1):
        assert not (isinstance(value, float) and math.isnan(value))


def test_no_records_give_an_empty_valid_table():
    assert tensor_stats_from_sketches([]).height == 0
