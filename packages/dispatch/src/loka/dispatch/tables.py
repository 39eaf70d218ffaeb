"""Reading the tables Dispatch works from: Probe's output folder and saved plans."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

from loka.dispatch.planner import Plan, PlanSummary
from loka.schema import read_metadata, read_table

__all__ = [
    "load_probe_tables",
    "read_plan",
]

PROBE_TABLES = ("sites", "site_errors")


def load_probe_tables(directory: str | os.PathLike[str]) -> dict[str, pl.DataFrame]:
    """`sites` and `site_errors` (and `tensor_stats` when present) from a folder written by
    `Probe.save` or `loka probe`. A missing file or a table of another schema version
    raises, naming the file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no probe tables folder {directory} (run `loka probe` first)")
    out = {}
    for name in PROBE_TABLES:
        path = directory / f"{name}.parquet"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: {directory} is not a probe tables folder")
        out[name] = read_table(path, name)
    stats = directory / "tensor_stats.parquet"
    if stats.exists():
        out["tensor_stats"] = read_table(stats, "tensor_stats")
    return out


def read_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan written by `Plan.write` (or `loka plan`): the table, its metadata, and the
    summary recorded with it."""
    table = read_table(path, "plan")
    metadata = read_metadata(path)
    summary = None
    if "summary" in metadata:
        summary = PlanSummary.from_dict(json.loads(metadata["summary"]))
    if summary is None:
        raise ValueError(f"{path}: a plan table without the planner's summary metadata")
    return Plan(table, summary, metadata)
