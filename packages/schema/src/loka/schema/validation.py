"""Checking a DataFrame against a table definition."""

from __future__ import annotations

import polars as pl

from loka.schema.tables import SCHEMA_VERSION, Column, Table, table

# Widening casts that lose nothing; anything else is a schema error, not a silent conversion.
_SAFE_CASTS: dict[type[pl.DataType], tuple[type[pl.DataType], ...]] = {
    pl.Int64: (pl.Int8, pl.Int16, pl.Int32, pl.UInt8, pl.UInt16, pl.UInt32),
    pl.Float64: (pl.Float32, pl.Int8, pl.Int16, pl.Int32, pl.UInt8, pl.UInt16),
    pl.String: (pl.Categorical, pl.Enum),
}


class SchemaError(ValueError):
    """A table that does not match LoKA's contract. The message names the source, the
    column and the schema versions involved."""


def _where(source: str | None, tbl: Table) -> str:
    return f"{source or 'in-memory table'} (table {tbl.name!r})"


def _castable(got: pl.DataType, want: pl.DataType) -> bool:
    if got == want:
        return True
    if isinstance(got, pl.Null):
        return True
    return any(isinstance(got, t) for t in _SAFE_CASTS.get(type(want), ()))


def validate(
    df: pl.DataFrame,
    table_name: str,
    *,
    source: str | None = None,
    file_version: int = SCHEMA_VERSION,
) -> pl.DataFrame:
    """Return `df` with the table's columns in canonical order and canonical dtypes.

    A column added after schema version 1 that `df` lacks is filled with its default (null
    unless the column says otherwise). Raises SchemaError naming the source, the column and
    both schema versions when any other column is missing, has a type that cannot be widened losslessly, holds nulls where none are
    allowed, holds a value outside a closed vocabulary or outside its column's range (a
    negative size, a NaN time, an M no GEMM takes), or when two rows share a key.
    Columns the table does not define are kept, after the defined ones.
    """
    tbl = table(table_name)
    where = _where(source, tbl)
    versions = f"file schema version {file_version}, loka-schema version {SCHEMA_VERSION}"
    if not isinstance(df, pl.DataFrame):
        raise SchemaError(f"{where}: expected a polars DataFrame, got {type(df).__name__}")

    missing = [c.name for c in tbl.columns if c.name not in df.columns and not c.optional]
    if missing:
        raise SchemaError(f"{where}: missing column(s) {missing} ({versions})")
    added = [c for c in tbl.columns if c.name not in df.columns]
    if added:  # columns of a later version than the frame's writer knew: their defaults
        df = df.with_columns(pl.lit(c.default, dtype=c.dtype).alias(c.name) for c in added)

    casts = []
    for col in tbl.columns:
        got = df.schema[col.name]
        if not _castable(got, col.dtype):
            raise SchemaError(
                f"{where}: column {col.name!r} has type {got}, expected {col.dtype} ({versions})"
            )
        casts.append(pl.col(col.name).cast(col.dtype))
    extras = [c for c in df.columns if c not in tbl.schema]
    out = df.select([*casts, *extras])

    for col in tbl.columns:
        series = out[col.name]
        if not col.nullable and series.null_count():
            raise SchemaError(
                f"{where}: column {col.name!r} has {series.null_count()} null value(s) "
                f"but may not be null ({versions})"
            )
        if col.allowed is not None:
            bad = series.drop_nulls().filter(~series.drop_nulls().is_in(list(col.allowed)))
            if len(bad):
                raise SchemaError(
                    f"{where}: column {col.name!r} holds {bad.unique().sort().to_list()}, "
                    f"allowed values are {list(col.allowed)}"
                )
        if col.range is not None:
            _check_range(series, col, where)

    if len(out) and out.select(tbl.key).is_duplicated().any():
        dup = out.filter(out.select(tbl.key).is_duplicated()).select(tbl.key).row(0)
        raise SchemaError(f"{where}: key {dict(zip(tbl.key, dup, strict=True))} appears twice")
    return out


def _check_range(series: pl.Series, col: Column, where: str) -> None:
    r = col.range
    values = series.drop_nulls()
    if not len(values):
        return
    bad = (values < r.low) | (values > r.high)
    if values.dtype.is_float():
        bad = bad.fill_null(False)
        # polars orders NaN above every number, so the comparisons above flag it: undo that
        # where NaN is allowed, insist where it is not
        bad = (bad & ~values.is_nan()) if r.nan else (bad | values.is_nan())
        if r.finite:
            bad = bad | values.is_infinite()
    if bad.any():
        first = values.filter(bad)[0]
        raise SchemaError(
            f"{where}: column {col.name!r} holds {first!r} ({bad.sum()} impossible value(s)); "
            f"its values must be {r.describe(values.dtype.is_integer())}"
        )


def empty(table_name: str) -> pl.DataFrame:
    """An empty DataFrame with the table's schema."""
    return pl.DataFrame(schema=table(table_name).schema)
