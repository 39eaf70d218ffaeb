"""A table cannot lie: a damaged file reads back as written or fails with SchemaError naming
it; never a panic, never changed values. Plus the value ranges, file modes and leftovers."""

import math
import os
import socket

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loka.schema.io as schema_io
from loka.schema import TABLES, SchemaError, TableWriteError, read_table, validate, write_table
from loka.schema.atomic import clean_stale
from loka.schema.testing import sample

KINDS = sorted(TABLES)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tables")
    out = {}
    for name in KINDS:
        path = folder / f"{name}.parquet"
        write_table(sample(name), path, name)
        out[name] = (path.read_bytes(), read_table(path, name))
    return out


def _read_damaged(tmp_path, name, data):
    path = tmp_path / f"damaged-{name}.parquet"
    path.write_bytes(data)
    try:
        return read_table(path, name), None
    except SchemaError as exc:
        assert str(path) in str(exc)
        assert "\n" not in str(exc)
        return None, exc


@settings(
    max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(KINDS),
    flips=st.lists(st.tuples(st.integers(0, 2**32), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_flipped_bytes_read_back_unchanged_or_fail_with_schema_error(
    written, tmp_path, name, flips
):
    original, content = written[name]
    data = bytearray(original)
    for position, mask in flips:
        data[position % len(data)] ^= mask
    df, _ = _read_damaged(tmp_path, name, bytes(data))  # anything but SchemaError escapes
    if df is not None:
        assert df.equals(content)


@pytest.mark.parametrize("name", KINDS)
def test_every_single_bit_flip_is_refused(written, tmp_path, name):
    original, _ = written[name]
    for position in range(0, len(original), 7 if name == "tensor_stats" else 3):
        data = bytearray(original)
        data[position] ^= 1 << (position % 8)
        df, _ = _read_damaged(tmp_path, name, bytes(data))
        assert df is None, f"a flip at byte {position} read back without error"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.sampled_from(KINDS), keep=st.floats(0, 1, exclude_max=True))
def test_truncated_tables_fail_with_schema_error(written, tmp_path, name, keep):
    original, _ = written[name]
    df, exc = _read_damaged(tmp_path, name, original[: int(len(original) * keep)])
    assert df is None and exc is not None


def _legacy(path, df, name):
    """A table as loka-schema wrote it before the checksum: footer keys, no checksum."""
    df.write_parquet(path, metadata={"loka.table": name, "loka.schema_version": "1"})


def test_tables_written_before_the_checksum_still_read(tmp_path):
    path = tmp_path / "sites.parquet"
    _legacy(path, sample("sites"), "sites")
    assert read_table(path, "sites").equals(sample("sites"))


def test_a_decoder_panic_becomes_a_schema_error_naming_the_file(tmp_path, monkeypatch):
    class FakePanic(BaseException):  # pyo3's PanicException derives from BaseException
        pass

    def panic(*args, **kwargs):
        raise FakePanic("assertion failed: offset + length <= self.length")

    path = tmp_path / "sites.parquet"
    write_table(sample("sites"), path, "sites")
    monkeypatch.setattr(schema_io.pl, "read_parquet", panic)
    with pytest.raises(SchemaError, match=r"sites\.parquet: damaged table, cannot decode it"):
        read_table(path, "sites")
    monkeypatch.setattr(schema_io.pl, "read_parquet_metadata", panic)
    with pytest.raises(SchemaError, match=r"sites\.parquet: not a readable parquet file"):
        read_table(path, "sites")


def test_a_directory_in_place_of_a_table_is_one_clear_error(tmp_path):
    (tmp_path / "sites.parquet").mkdir()
    with pytest.raises(SchemaError, match="is a directory"):
        read_table(tmp_path / "sites.parquet", "sites")
    with pytest.raises(TableWriteError, match="is a directory"):
        write_table(sample("sites"), tmp_path / "sites.parquet", "sites")


IMPOSSIBLE = [
    ("sites", "K", -1, ">= 0"),
    ("sites", "N", -4096, ">= 0"),
    ("sites", "M_max", 2**31, "<= 2147483647"),
    ("sites", "M_min", -5, ">= 0"),
    ("sites", "calls", -1, ">= 0"),
    ("sites", "fwd_ms", math.nan, "not NaN"),
    ("sites", "bwd_ms", -0.5, ">= 0"),
    ("sites", "fwd_ms", math.inf, "finite"),
    ("sites", "time_share", -0.1, ">= 0"),
    ("kernel_bench", "median_ms", math.nan, "not NaN"),
    ("kernel_bench", "median_ms", -1.0, ">= 0"),
    ("kernel_bench", "M_bucket", 0, ">= 1"),
    ("kernel_bench", "K", -128, ">= 0"),
    ("kernel_bench", "groups", 0, ">= 1"),
    ("kernel_bench", "tflops", math.nan, "not NaN"),
    ("plan", "K", -1, ">= 0"),
    ("plan", "M_p50", 2**40, "<= 2147483647"),
    ("plan", "bf16_ms", -2.0, ">= 0"),
    ("site_errors", "n", -3, ">= 0"),
    ("site_errors", "confidence", 1.5, "<= 1"),
    ("site_errors", "budget", math.nan, "not NaN"),
    ("site_errors", "mean_rel_err", -0.1, ">= 0"),
    ("tensor_stats", "count", -1, ">= 0"),
    ("tensor_stats", "amax", math.nan, "not NaN"),
    ("tensor_stats", "e4m3_tensor_saturated", 1.5, "<= 1"),
]


def _with(name, column, value):
    df = sample(name)
    return df.with_columns(pl.Series(column, [value] * df.height, dtype=df.schema[column]))


@pytest.mark.parametrize(("name", "column", "value", "rule"), IMPOSSIBLE)
def test_impossible_values_are_refused_on_write_and_on_read(tmp_path, name, column, value, rule):
    path = tmp_path / f"{name}.parquet"
    bad = _with(name, column, value)
    with pytest.raises(SchemaError, match=rf"column '{column}' holds .*must be .*{rule}"):
        write_table(bad, path, name)
    assert not path.exists()
    _legacy(path, bad, name)  # written by something else: the reader checks too
    with pytest.raises(SchemaError, match=rf"{name}\.parquet.*column '{column}'"):
        read_table(path, name)


def test_possible_edge_values_pass():
    validate(_with("sites", "K", 0), "sites")  # a site registered but never run
    validate(_with("sites", "M_max", 2**31 - 1), "sites")
    validate(_with("plan", "bf16_ms", math.nan), "plan")  # NaN: a pass with no timing
    validate(_with("site_errors", "ucb_rel_err", math.nan), "site_errors")


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_tables_get_the_mode_an_ordinary_file_gets(tmp_path, mask):
    old = os.umask(mask)
    try:
        write_table(sample("sites"), tmp_path / "sites.parquet", "sites")
        (tmp_path / "ordinary").write_text("x")
    finally:
        os.umask(old)
    mode = (tmp_path / "sites.parquet").stat().st_mode & 0o777
    assert mode == (tmp_path / "ordinary").stat().st_mode & 0o777 == 0o666 & ~mask


def _dead_pid() -> int:
    pid = 2**22 - 1  # above the usual pid_max; checked anyway
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1


def test_a_killed_writes_leftover_is_removed_on_the_next_write(tmp_path):
    host = socket.gethostname().replace(".", "_")[:32]
    dead = tmp_path / f".sites.parquet.{host}.{_dead_pid()}.abc123.tmp"
    alive = tmp_path / f".sites.parquet.{host}.{os.getpid()}.def456.tmp"
    old_unowned = tmp_path / ".sites.parquet.k3j4l5.tmp"
    new_unowned = tmp_path / ".sites.parquet.q9w8e7.tmp"
    other_file = tmp_path / ".plan.parquet.k3j4l5.tmp"
    for leftover in (dead, alive, old_unowned, new_unowned, other_file):
        leftover.write_bytes(b"x" * 1000)
    os.utime(old_unowned, (0, 0))
    os.utime(other_file, (0, 0))
    write_table(sample("sites"), tmp_path / "sites.parquet", "sites")
    assert not dead.exists() and not old_unowned.exists()
    assert alive.exists() and new_unowned.exists() and other_file.exists()
    assert clean_stale(tmp_path / "sites.parquet") == []
