"""bench/session_step.py on the CPU (DHEN tiny): a Session on a compiled model trained to
its plan, then timed against its plain compiled twin in interleaved blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("session_step")


def test_a_session_and_its_plain_twin_are_timed_in_interleaved_blocks(tmp_path) -> None:
    assert script.main(["--out", str(tmp_path), "--device", "cpu", "--preset", "tiny",
                        "--warmup-steps", "4", "--decide-steps", "0", "--blocks", "3",
                        "--block-steps", "1", "--batches", "2", "--backend", "eager"]) == 0  # fmt: skip
    (result,) = tmp_path.glob("session_step_*.json")
    data = json.loads(result.read_text())["result"]
    assert data["phase"] == "applied" and data["steps_in_session_phase"] == 4
    assert len(data["block_ms"]["plain"]) == len(data["block_ms"]["session"]) == 3
    assert data["speedup_vs_bf16"] > 0 and data["summary"]
    assert any("runs eagerly while Probe" in e for e in data["events"])
    # no graph break, neither while Probe watched (the model ran eagerly) nor after (one
    # graph may serve both models where their modules are alike: parameters are inputs)
    assert data["dynamo_session_phase"]["graph_breaks"] == 0
    assert data["dynamo_after"]["graph_breaks"] == 0
    assert data["dynamo_after"]["unique_graphs"] >= 1
