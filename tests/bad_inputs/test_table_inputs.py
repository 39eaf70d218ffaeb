"""Damaged, foreign and impossible tables: through `loka plan` and through loka.schema."""

from __future__ import annotations

import math

import polars as pl
import pytest

from loka.schema import SchemaError, TableWriteError, read_metadata, read_table, write_table
from loka.schema.testing import sample

PROBE_TABLES = ("sites", "tensor_stats", "site_errors")
KINDS = (*PROBE_TABLES, "kernel_bench", "plan")


def _probe_folder(folder):
    folder.mkdir()
    for name in PROBE_TABLES:
        df = sample(name)
        if name == "site_errors":
            df = df.with_columns(pl.lit("e4m3:e4m3/row/dynamic").alias("recipe"))
        write_table(df, folder / f"{name}.parquet", name)
    return folder


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = b""
    elif how == "text":
        data = b"site,K\nmlp,128\n"
    elif how == "footer":
        data[-20] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = ("flip", "truncate", "empty", "text", "footer")


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", PROBE_TABLES)
def test_plan_with_a_damaged_probe_table(loka, tmp_path, name, how):
    folder = _probe_folder(tmp_path / "probe")
    _damage(folder / f"{name}.parquet", how)
    line = loka("plan", "--tables", folder, "--out", tmp_path / "plan.parquet")
    assert f"{name}.parquet" in line
    assert not (tmp_path / "plan.parquet").exists()


@pytest.mark.parametrize("how", DAMAGE)
def test_plan_with_a_damaged_kernel_bench(loka, tmp_path, how):
    folder = _probe_folder(tmp_path / "probe")
    bench = tmp_path / "kb.parquet"
    write_table(sample("kernel_bench"), bench, "kernel_bench")
    _damage(bench, how)
    line = loka(
        "plan", "--tables", folder, "--kernel-bench", bench, "--out", tmp_path / "p.parquet"
    )
    assert "kb.parquet" in line


@pytest.mark.parametrize("name", ["sites", "site_errors"])  # tensor_stats is optional
def test_plan_with_a_missing_probe_table(loka, tmp_path, name):
    folder = _probe_folder(tmp_path / "probe")
    (folder / f"{name}.parquet").unlink()
    assert f"{name}.parquet is missing" in loka("plan", "--tables", folder)


@pytest.mark.parametrize("name", PROBE_TABLES)
def test_plan_with_a_directory_in_place_of_a_table(loka, tmp_path, name):
    folder = _probe_folder(tmp_path / "probe")
    (folder / f"{name}.parquet").unlink()
    (folder / f"{name}.parquet").mkdir()
    assert "directory" in loka("plan", "--tables", folder)


@pytest.mark.parametrize("name", PROBE_TABLES)
def test_plan_with_another_table_in_place(loka, tmp_path, name):
    folder = _probe_folder(tmp_path / "probe")
    other = "plan"
    write_table(sample(other), folder / f"{name}.parquet", other)
    assert f"holds table 'plan', expected '{name}'" in loka("plan", "--tables", folder)


@pytest.mark.parametrize(
    "where", ["nowhere", "[/pow2]", "[red]x", "a file"], ids=["absent", "pow2", "red", "file"]
)
def test_plan_tables_folder_that_is_not_one(loka, tmp_path, where):
    target = tmp_path / where
    if where == "a file":
        target.write_text("x")
    line = loka("plan", "--tables", target)
    assert str(target) in line


def test_plan_out_is_a_directory(loka, tmp_path):
    folder = _probe_folder(tmp_path / "probe")
    assert "is a directory" in loka("plan", "--tables", folder, "--out", tmp_path)


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", KINDS)
def test_read_table_of_a_damaged_file_is_one_schema_error(tmp_path, one_line, name, how):
    path = tmp_path / f"{name}.parquet"
    write_table(sample(name), path, name)
    _damage(path, how)
    with pytest.raises(SchemaError) as info:
        read_table(path, name)
    assert str(path) in one_line(info)


@pytest.mark.parametrize("name", KINDS)
def test_read_metadata_of_a_damaged_file_is_one_schema_error(tmp_path, one_line, name):
    path = tmp_path / f"{name}.parquet"
    write_table(sample(name), path, name, metadata={"k": "v"})
    _damage(path, "flip")
    with pytest.raises(SchemaError) as info:
        read_metadata(path)
    assert str(path) in one_line(info)


IMPOSSIBLE = [
    ("sites", "K", -1),
    ("sites", "N", -1),
    ("sites", "M_p50", 2**31),
    ("sites", "M_max", 2**62),
    ("sites", "calls", -3),
    ("sites", "groups", 0),
    ("sites", "fwd_ms", math.nan),
    ("sites", "bwd_ms", -1.0),
    ("sites", "fwd_ms", math.inf),
    ("tensor_stats", "window", -1),
    ("tensor_stats", "nan", -1),
    ("tensor_stats", "amax", -2.0),
    ("tensor_stats", "e5m2_block_underflow", 2.0),
    ("site_errors", "n", -1),
    ("site_errors", "std_rel_err", -0.5),
    ("site_errors", "confidence", math.nan),
    ("kernel_bench", "K", 2**31),
    ("kernel_bench", "median_ms", math.nan),
    ("kernel_bench", "median_ms", math.inf),
    ("kernel_bench", "tflops", -1.0),
    ("plan", "N", -7),
    ("plan", "predicted_ms", -0.1),
]


@pytest.mark.parametrize(("name", "column", "value"), IMPOSSIBLE)
def test_write_table_refuses_impossible_values(tmp_path, one_line, name, column, value):
    df = sample(name)
    df = df.with_columns(pl.Series(column, [value] * df.height, dtype=df.schema[column]))
    with pytest.raises(SchemaError) as info:
        write_table(df, tmp_path / "t.parquet", name)
    assert f"column {column!r}" in one_line(info)


@pytest.mark.parametrize(
    ("call", "error", "needle"),
    [
        (lambda p: read_table(p / "absent.parquet", "sites"), FileNotFoundError, "no such table"),
        (lambda p: read_table(p, "sites"), SchemaError, "is a directory"),
        (lambda p: read_table(p / "x.parquet", "site"), KeyError, "unknown table"),
        (
            lambda p: write_table(sample("sites"), p / "no" / "x.parquet", "sites"),
            TableWriteError,
            "does not exist",
        ),
        (lambda p: write_table(sample("sites"), p, "sites"), TableWriteError, "is a directory"),
        (lambda p: write_table(sample("sites"), p / "x.parquet", "plan"), SchemaError, "missing"),
        (lambda p: write_table("not a frame", p / "x.parquet", "sites"), SchemaError, "DataFrame"),
        (
            lambda p: write_table(sample("sites").drop("K"), p / "x.parquet", "sites"),
            SchemaError,
            "missing column",
        ),
        (
            lambda p: write_table(
                sample("sites").with_columns(pl.col("K").cast(pl.String)), p / "x.parquet", "sites"
            ),
            SchemaError,
            "has type",
        ),
        (
            lambda p: write_table(pl.concat([sample("sites")] * 2), p / "x.parquet", "sites"),
            SchemaError,
            "appears twice",
        ),
        (
            lambda p: write_table(
                sample("sites").with_columns(pl.lit("conv").alias("kind")), p / "x.parquet", "sites"
            ),
            SchemaError,
            "allowed values",
        ),
    ],
)
def test_schema_entry_points(tmp_path, one_line, call, error, needle):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert needle in one_line(info)
