"""`loka report` refuses a plan made for another model's tables (issue 16 item 8), as
`apply` refuses a plan made for another model: one line naming both fingerprints, exit 1,
no report written."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import sys

sys.path.insert(0, os.path.dirname(__file__))  # the planner tests' table builders
from test_dispatch_planner import BF16_ROWS, ROW, bench_table, errors_table, sites_table

from loka.dispatch.cli import main
from loka.dispatch.planner import make_plan
from loka.schema import PASSES, write_table


def _model(tmp_path, name: str, sites: list[tuple]) -> tuple:
    """A probe tables folder and a plan (file) for a model of `sites`."""
    folder = tmp_path / name
    folder.mkdir()
    sites_df = sites_table(*sites)
    errors = errors_table([(s[0], ROW, p, 0.05, "safe") for s in sites for p in PASSES])
    bench = bench_table(BF16_ROWS + [("triton.fp8", ROW, p, 0.5, 0.05) for p in PASSES])
    write_table(sites_df, folder / "sites.parquet", "sites")
    write_table(errors, folder / "site_errors.parquet", "site_errors")
    plan = make_plan(sites_df, errors, bench).write(tmp_path / f"{name}-plan.parquet")
    return folder, plan


def test_report_refuses_another_models_plan(tmp_path, capsys) -> None:
    a_tables, a_plan = _model(tmp_path, "a", [("fc", 1024, 4096, 8192, 0.5)])
    b_tables, b_plan = _model(tmp_path, "b", [("fc", 1024, 4096, 8192, 0.5),
                                              ("proj", 4096, 1024, 8192, 0.3)])  # fmt: skip
    out = tmp_path / "report.html"
    assert (
        main(["report", "--tables", str(a_tables), "--plan", str(a_plan), "--out", str(out)]) == 0
    )
    assert out.exists()
    out.unlink()
    capsys.readouterr()
    for tables, plan in ((a_tables, b_plan), (b_tables, a_plan)):
        assert main(["report", "--tables", str(tables), "--plan", str(plan),
                     "--out", str(out)]) == 1  # fmt: skip
        text = capsys.readouterr().out
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), text
        assert "another model" in text and str(plan.name) in text and "fingerprint" in text
        assert not out.exists()
