"""The on-disk cache of measured `kernel_bench` rows, one file per machine identity.

Rows are measured once per (backend, recipe, pass, M bucket, K, N, groups) on a given GPU,
driver, torch and triton, and reused by every later `loka bench` or planning run there. A
file measured elsewhere is never used silently: loading it for this machine raises
`CacheMismatchError` naming what differs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

from loka.dispatch.device import FINGERPRINT_COLUMNS, DeviceInfo
from loka.schema import empty, read_metadata, read_table, table, write_table

KEY = table("kernel_bench").key


class CacheMismatchError(ValueError):
    """A kernel_bench table or cache measured on another GPU, driver or software version."""


def default_cache_dir() -> Path:
    """`$LOKA_CACHE_DIR`, else `$XDG_CACHE_HOME/loka`, else `~/.cache/loka`."""
    if os.environ.get("LOKA_CACHE_DIR"):
        return Path(os.environ["LOKA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loka"


def table_devices(df: pl.DataFrame) -> list[DeviceInfo]:
    """The distinct machine identities of a kernel_bench table's rows."""
    if df.is_empty():
        return []
    rows = df.select(FINGERPRINT_COLUMNS).unique(maintain_order=True).to_dicts()
    return [DeviceInfo.from_row(r) for r in rows]


def check_same_device(df: pl.DataFrame, expected: DeviceInfo, source: str) -> None:
    """Raise CacheMismatchError unless every row of `df` was measured on `expected`."""
    for found in table_devices(df):
        if found != expected:
            raise CacheMismatchError(
                f"{source}: measured on {found.describe()}, not on this machine, "
                f"{expected.describe()}; differs in: {'; '.join(expected.differences(found))}. "
                "It is not used for timing here: run `loka bench` on this machine, or use the "
                "table as a cost model (`--estimate-from`), whose results are marked estimated"
            )


class BenchCache:
    """`kernel_bench` rows per machine identity under `directory/kernel_bench/`."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, device: DeviceInfo) -> Path:
        return self.directory / "kernel_bench" / f"{device.slug}.parquet"

    def load(self, device: DeviceInfo) -> pl.DataFrame:
        """Measured rows for `device` (empty when none were cached)."""
        path = self.path(device)
        if not path.exists():
            return empty("kernel_bench")
        df = read_table(path, "kernel_bench")
        check_same_device(df, device, str(path))
        return df

    def store(self, device: DeviceInfo, rows: pl.DataFrame) -> Path:
        """Merge measured `rows` of `device` into its file (new rows replace old ones with the
        same key); atomic. Estimated rows are never cached."""
        check_same_device(rows, device, "rows to cache")
        if rows.filter(pl.col("estimated")).height:
            raise ValueError("estimated rows are not measurements; they are not cached")
        path = self.path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = self.load(device)
        merged = pl.concat([old, rows], how="diagonal_relaxed").unique(
            subset=list(KEY), keep="last", maintain_order=True
        )
        write_table(merged, path, "kernel_bench", metadata={"device": json.dumps(device.as_dict())})
        return path

    def others(self, device: DeviceInfo) -> list[DeviceInfo]:
        """Machine identities of the other cache files in this directory."""
        found = []
        folder = self.directory / "kernel_bench"
        for path in sorted(folder.glob("*.parquet")) if folder.is_dir() else []:
            if path == self.path(device):
                continue
            try:
                found.append(DeviceInfo(**json.loads(read_metadata(path)["device"])))
            except (KeyError, ValueError, TypeError):
                continue  # not one of ours; ignored
        return found
