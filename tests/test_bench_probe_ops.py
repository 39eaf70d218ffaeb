"""bench/probe_ops.py on the CPU (DHEN tiny): a row per counted sampled step, with ops, per
variant of the error graphs (on the CPU both run eagerly: graphs are a GPU's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("probe_ops")


def test_it_counts_the_analysis_ops_of_each_sampled_step(tmp_path) -> None:
    assert script.main(["--out", str(tmp_path), "--preset", "tiny", "--batch-size", "32",
                        "--steps", "2", "--error-graphs", "off,on+host=0", "--blocks", "1"]) == 0  # fmt: skip
    (result,) = tmp_path.glob("probe_ops_*.json")
    data = json.loads(result.read_text())
    assert [r["variant"] for r in data["rows"]] == ["off", "off", "on+host=0", "on+host=0"]
    assert all(r["ops"] > 100 and r["seconds"] > 0 for r in data["rows"])
    assert data["rows"][-1]["counters"]["graph_replays"] == 0  # nothing graphed on a CPU
    assert data["meta"]["model"] == "dhen" and data["meta"]["sites"] > 0
