"""bench/varying_error.py: Probe's varying error per site and the collapse diagnostic, on the
CPU (a tiny model, a few steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("varying_error")


def test_the_collapse_diagnostic_sees_centering_recover_a_collapsed_output():
    # A linear fed one shared vector plus 0.5% per token: e4m3 loses the part that varies,
    # e4m3 of the centered input keeps it, bf16 sits between.
    import loka.zoo as zoo

    setup = zoo.create("dlrm", "tiny", batch_size=64)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    shared = torch.randn(1, 64)

    class Collapsed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, batch) -> torch.Tensor:
            return self.layer(shared + 0.005 * torch.randn(256, 64)).float().mean()

    setup.model = Collapsed()
    setup.loss = lambda model, batch: model(batch)
    (row,) = script.collapse(setup, torch.bfloat16)
    assert row["site"] == "layer" and row["spread"] < 0.02
    assert row["e4m3_row_varying"] > 1.0
    assert row["e4m3_row_centered_varying"] < 0.1 < row["bf16_varying"] < 1.0


def test_the_script_writes_every_sites_errors_and_its_collapse_rows(tmp_path):
    script.main(["--models", "dlrm", "--preset", "tiny", "--batch", "128", "--rows", "64",
                 "--steps", "3", "--device", "cpu", "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("varying_error_cpu_*.json")
    result = json.loads(path.read_text())
    # centering is a projection: the varying share of an output is at most all of it
    assert result["collapse"] and all(0 <= r["spread"] <= 1 for r in result["collapse"])
    for r in result["rows"]:
        assert r["varying_rel_err"] >= 0 and r["summed_rel_err"] >= 0
        assert r["balanced_rel_err"] > 0
    for part in ("varying", "summed"):
        assert result["changed"][part] == sum(
            r["balanced_within_budget"] and not r[f"{part}_within_budget"] for r in result["rows"]
        )
    # the summed error is a dgrad's: elsewhere the excess reads the balanced errors'
    assert any(r["pass"] == "dgrad" and r["recipe"].endswith("/center") for r in result["rows"])


def test_an_override_is_a_literal_where_it_is_one():
    assert script.parse_override("max_table_rows=200000") == ("max_table_rows", 200000)
    assert script.parse_override("layout=padded") == ("layout", "padded")
    assert script.parse_override("widths=(4, 8)") == ("widths", (4, 8))
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        script.parse_override("max_table_rows")
