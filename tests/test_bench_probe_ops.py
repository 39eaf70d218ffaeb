"""bench/probe_ops.py on the CPU (DHEN tiny): a row per counted sampled step, with ops."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"


def test_it_counts_the_analysis_ops_of_each_sampled_step(tmp_path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from harness import load

        script = load("probe_ops")
        assert script.main(["--out", str(tmp_path), "--preset", "tiny", "--batch-size", "32",
                            "--steps", "2"]) == 0  # fmt: skip
    finally:
        sys.path.remove(str(BENCH))
    (result,) = tmp_path.glob("probe_ops_*.json")
    data = json.loads(result.read_text())
    assert len(data["rows"]) == 2
    assert all(r["ops"] > 100 and r["seconds"] > 0 for r in data["rows"])
    assert data["meta"]["model"] == "dhen" and data["meta"]["sites"] > 0
