"""Parquet IO for LoKA tables: validated on the way in and out, written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import polars as pl

from loka.schema.tables import SCHEMA_VERSION, table
from loka.schema.validate import SchemaError, validate

_TABLE_KEY = "loka.table"
_VERSION_KEY = "loka.schema_version"
_USER_PREFIX = "loka.meta."


class TableWriteError(OSError):
    """Writing a table failed; the destination was left as it was."""


def write_table(
    df: pl.DataFrame,
    path: str | os.PathLike,
    table_name: str,
    *,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Validate `df` as `table_name` and write it to `path` as parquet, atomically.

    The file is written beside the destination and renamed over it, so a reader sees either
    the old file or the complete new one. `metadata` (string to string) is stored in the
    parquet footer and returned by `read_metadata`.
    """
    path = Path(path)
    out = validate(df, table_name, source=str(path))
    kv = {_TABLE_KEY: table_name, _VERSION_KEY: str(SCHEMA_VERSION)}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
        kv[_USER_PREFIX + key] = value

    directory = path.parent
    if not directory.is_dir():
        raise TableWriteError(f"cannot write {path}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise TableWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            out.write_parquet(fh, metadata=kv)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise TableWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The user metadata stored with a LoKA table (without LoKA's own keys)."""
    kv = _footer(Path(path))
    return {k[len(_USER_PREFIX) :]: v for k, v in kv.items() if k.startswith(_USER_PREFIX)}


def _footer(path: Path) -> dict[str, str]:
    if not path.exists():
        raise FileNotFoundError(f"no such table file: {path}")
    try:
        return pl.read_parquet_metadata(path)
    except Exception as exc:  # polars raises its own ComputeError/OSError variants
        raise SchemaError(f"{path}: not a readable parquet file ({exc})") from exc


def read_table(path: str | os.PathLike, table_name: str) -> pl.DataFrame:
    """Read and validate a table written by `write_table` (or any parquet file with the
    table's columns and LoKA's footer keys).

    Fails with SchemaError naming the file, the column and both versions when the file is a
    different table, another schema version, or misses or mistypes a column.
    """
    path = Path(path)
    table(table_name)  # unknown names fail before touching the file
    kv = _footer(path)
    found = kv.get(_TABLE_KEY)
    if found is None:
        raise SchemaError(f"{path}: not a LoKA table (no {_TABLE_KEY!r} key in its metadata)")
    if found != table_name:
        raise SchemaError(f"{path}: holds table {found!r}, expected {table_name!r}")
    try:
        version = int(kv.get(_VERSION_KEY, ""))
    except ValueError:
        raise SchemaError(f"{path}: unreadable schema version {kv.get(_VERSION_KEY)!r}") from None
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"{path}: table {table_name!r} has schema version {version}, "
            f"this loka-schema reads version {SCHEMA_VERSION}"
        )
    df = pl.read_parquet(path)
    return validate(df, table_name, source=str(path), file_version=version)
