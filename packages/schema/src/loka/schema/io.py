"""Parquet IO for LoKA tables: validated on the way in and out, written atomically,
checksummed so that a damaged file is refused rather than misread."""

from __future__ import annotations

import io
import os
from pathlib import Path

import polars as pl

from loka.schema import integrity
from loka.schema.atomic import atomic_write
from loka.schema.tables import OLDEST_READABLE_VERSION, SCHEMA_VERSION, table
from loka.schema.validation import SchemaError, validate

_TABLE_KEY = "loka.table"
_VERSION_KEY = "loka.schema_version"
_USER_PREFIX = "loka.meta."

# Exceptions a damaged file must never be blamed for: the user asked to stop, or the process
# is exiting. Everything else a decoder raises (polars' Rust panics are BaseExceptions) is
# the file's fault and becomes a SchemaError naming it.
_NOT_THE_FILES_FAULT = (KeyboardInterrupt, SystemExit, GeneratorExit)


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
    parquet footer and returned by `read_metadata`, beside a checksum of the file's bytes
    that `read_table` verifies. The file gets the mode of an ordinary new file (0666 less
    the umask); a temporary file that a killed earlier write left beside `path` is removed.
    """
    path = Path(path)
    out = validate(df, table_name, source=str(path))
    kv = {
        _TABLE_KEY: table_name,
        _VERSION_KEY: str(SCHEMA_VERSION),
        integrity.KEY: integrity.PLACEHOLDER,
    }
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
        kv[_USER_PREFIX + key] = value

    directory = path.parent
    if not directory.is_dir():
        raise TableWriteError(f"cannot write {path}: directory {directory} does not exist")
    if path.is_dir():
        raise TableWriteError(f"cannot write {path}: it is a directory")

    def write(tmp: str) -> None:
        out.write_parquet(tmp, metadata=kv)
        with open(tmp, "r+b") as fh:
            offset, digest = integrity.seal(fh.read())
            fh.seek(offset)
            fh.write(digest)

    try:
        atomic_write(path, write)
    except OSError as exc:
        raise TableWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The user metadata stored with a LoKA table (without LoKA's own keys)."""
    kv = _footer(Path(path), _verified_bytes(Path(path)))
    return {k[len(_USER_PREFIX) :]: v for k, v in kv.items() if k.startswith(_USER_PREFIX)}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _verified_bytes(path: Path) -> bytes:
    """The file's bytes, checked against its checksum before any decoder sees them."""
    if not path.exists():
        raise FileNotFoundError(f"no such table file: {path}")
    if path.is_dir():
        raise SchemaError(f"{path}: is a directory, not a table file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        integrity.verify(data)
    except integrity.DamagedFile as exc:
        raise SchemaError(f"{path}: {exc}") from None
    return data


def _footer(path: Path, data: bytes) -> dict[str, str]:
    try:
        return pl.read_parquet_metadata(io.BytesIO(data))
    except _NOT_THE_FILES_FAULT:
        raise
    except BaseException as exc:  # polars' own errors, OSError, and Rust panics
        raise SchemaError(f"{path}: not a readable parquet file ({_first_line(exc)})") from None


def read_table(path: str | os.PathLike, table_name: str) -> pl.DataFrame:
    """Read and validate a table written by `write_table` (or any parquet file with the
    table's columns and LoKA's footer keys).

    A file of an older schema version (from `OLDEST_READABLE_VERSION`) is migrated: the
    columns added since read as their defaults. Fails with SchemaError naming the file, the
    column and both versions when the file is a different table, a newer schema version, or misses or mistypes a column or holds an
    impossible value; and with SchemaError naming the file when its bytes do not match the
    checksum written with it or cannot be decoded. A file written before tables carried a
    checksum is read and validated without one.
    """
    path = Path(path)
    table(table_name)  # unknown names fail before touching the file
    data = _verified_bytes(path)
    kv = _footer(path, data)
    found = kv.get(_TABLE_KEY)
    if found is None:
        raise SchemaError(f"{path}: not a LoKA table (no {_TABLE_KEY!r} key in its metadata)")
    if found != table_name:
        raise SchemaError(f"{path}: holds table {found!r}, expected {table_name!r}")
    try:
        version = int(kv.get(_VERSION_KEY, ""))
    except ValueError:
        raise SchemaError(f"{path}: unreadable schema version {kv.get(_VERSION_KEY)!r}") from None
    if not OLDEST_READABLE_VERSION <= version <= SCHEMA_VERSION:
        raise SchemaError(
            f"{path}: table {table_name!r} has schema version {version}, "
            f"this loka-schema reads version {SCHEMA_VERSION} (and migrates files from version "
            f"{OLDEST_READABLE_VERSION} on)"
            + ("; the file was written by a newer loka-schema" if version > SCHEMA_VERSION else "")
        )
    try:
        df = pl.read_parquet(io.BytesIO(data))
    except _NOT_THE_FILES_FAULT:
        raise
    except BaseException as exc:
        raise SchemaError(f"{path}: damaged table, cannot decode it ({_first_line(exc)})") from None
    return validate(df, table_name, source=str(path), file_version=version)
