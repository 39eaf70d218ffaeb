"""Small valid frames of every LoKA table, built from the table definitions (for tests of
this package and of the packages that read its tables)."""

from __future__ import annotations

import polars as pl

from loka.schema import TABLES


def _value(col, i: int):
    dtype = col.dtype
    if col.allowed:
        return col.allowed[i % len(col.allowed)]
    if dtype == pl.String:
        return f"{col.name}.{i}"
    if dtype == pl.Int64:
        return 3 + 5 * i
    if dtype == pl.Float64:
        if col.nullable and i == 1:
            return None
        return 0.125 + 0.25 * i
    if dtype == pl.Boolean:
        return i % 2 == 0
    if dtype == pl.Binary:
        return bytes(range(i, i + 24))
    return [{"backend": f"b{i}", "recipe": "bf16", "reason": f"slower by {i}"}]


def sample(name: str, rows: int = 3) -> pl.DataFrame:
    tbl = TABLES[name]
    data = {c.name: [_value(c, i) for i in range(rows)] for c in tbl.columns}
    return pl.DataFrame(data, schema=tbl.schema)
