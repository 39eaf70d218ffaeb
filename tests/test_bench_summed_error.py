"""bench/summed_error.py: what an FP8 dgrad does to the gradients upstream, on the CPU (a
tiny model, a few steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("summed_error")


def test_the_dgrad_ways_compute_the_same_product_within_e4m3():
    g = torch.Generator().manual_seed(0)
    dy, weight = torch.randn(64, 32, generator=g), torch.randn(32, 48, generator=g)
    exact = dy @ weight
    for way, tolerance in (("bf16", 0.01), ("row", 0.06), ("center", 0.06)):
        got = script.dgrad(dy, weight, way)
        assert got.shape == exact.shape
        assert float((got - exact).norm() / exact.norm()) < tolerance, way
    # Gradients every token shares: centering quantizes nothing and keeps them exactly.
    shared = dy[:1].expand(64, 32)
    assert torch.allclose(script.dgrad(shared, weight, "center"), shared @ weight, atol=1e-5)
    assert not torch.allclose(script.dgrad(shared, weight, "row"), shared @ weight, atol=1e-3)


def test_the_script_writes_upstream_errors_and_summed_errors(tmp_path):
    script.main(["--model", "dhen", "--preset", "tiny", "--batch", "128", "--steps", "2",
                 "--batches", "2", "--sites", "blocks.*.fc2", "--device", "cpu",
                 "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("summed_error_cpu_*.json")
    rows = json.loads(path.read_text())["rows"]
    upstream = {(r["way"], r["group"]): r for r in rows if "group" in r}
    assert {w for w, _ in upstream} == {"bf16", "row", "center"}
    for group in ("blocks.*.fc1.weight", "input_projection.weight"):
        # e4m3 errs more than bf16 on every gradient upstream of the FP8 dgrads
        assert 0 < upstream[("bf16", group)]["per_batch"] < upstream[("row", group)]["per_batch"]
        assert upstream[("row", group)]["noise"] > 0
    summed = [r for r in rows if "site" in r]
    assert summed and all(r["site"].endswith("fc2") for r in summed)
    for r in summed:
        assert 0 <= r["summed_error"]["bf16"] < r["summed_error"]["row"]
