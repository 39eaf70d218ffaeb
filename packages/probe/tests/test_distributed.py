"""Two gloo ranks on the CPU: statistics merge so that every rank writes the same tables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl

from loka.schema import read_table

WORKER = Path(__file__).with_name("dist_worker.py")


def test_two_ranks_write_identical_merged_tables(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    init = tmp_path / "rendezvous"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(init), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output
    for name in ("sites", "tensor_stats", "site_errors"):
        tables = [read_table(tmp_path / f"rank{r}" / f"{name}.parquet", name) for r in range(2)]
        assert tables[0].equals(tables[1]), name

    errors = read_table(tmp_path / "rank0" / "site_errors.parquet", "site_errors")
    dynamic = errors.filter(~pl.col("recipe").str.contains("delayed"))
    assert set(dynamic["n"]) == {4 + 5}  # every batch of both ranks
    sites = read_table(tmp_path / "rank0" / "sites.parquet", "sites")
    assert sites["captured_steps"].to_list() == [9, 9] and sites["calls"].to_list() == [9, 9]
    stats = read_table(tmp_path / "rank0" / "tensor_stats.parquet", "tensor_stats")
    first_input = stats.filter((pl.col("site") == "0") & (pl.col("role") == "input"))
    assert first_input["count"].to_list() == [9 * 32 * 64]
    assert first_input["samples"].to_list() == [9]
