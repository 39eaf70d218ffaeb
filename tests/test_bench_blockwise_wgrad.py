"""bench/blockwise_wgrad.py: the 1x128 wgrad quantization, its layout for scaled_mm, and the
accuracy half on the CPU (the GEMM timings need the GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("blockwise_wgrad")


def test_the_blockwise_wgrad_operands_reproduce_the_product():
    torch.manual_seed(0)
    M, N, K = 512, 48, 80
    # Token magnitudes that move across the batch, gradient up where activation down: each
    # 128-token block adds as much to dW, but one scale per channel over all M tokens is set
    # by the largest block and leaves the smallest ones a few FP8 levels.
    spread = torch.tensor([100.0**b for b in range(4)]).repeat_interleave(128)
    dy, x = torch.randn(M, N) * spread[:, None], torch.randn(M, K) / spread[:, None]
    dq, di = script.quantize_1x128_transposed(dy)
    xq, xi = script.quantize_1x128_transposed(x)
    assert dq.shape == (N, M) and dq.dtype == torch.float8_e4m3fn and dq.is_contiguous()
    assert di.shape == (N, M // 128) and di.stride() == (1, N)  # scaled_mm's 1x128 layout
    want = dy.t() @ x
    got = script.wgrad_reference(dq, di, xq, xi)
    block_err = float((got - want).norm() / want.norm())
    rq, ri = script.quantize_rowwise_transposed(dy)
    rx, rxi = script.quantize_rowwise_transposed(x)
    row = (rq.float() * ri) @ (rx.float() * rxi).t()
    row_err = float((row - want).norm() / want.norm())
    assert block_err < 0.05 and row_err > 0.5
    # The same codes and scales as the recipes' definition of 1x128 blocks.
    from loka.schema import QuantConfig
    from loka.schema.fp8 import quantize_reference

    ref = quantize_reference(dy.t().contiguous(), QuantConfig("e4m3", "block", (1, 128)))
    assert torch.equal(dq.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.allclose(di, 1.0 / ref.scale)
    with pytest.raises(ValueError, match="M % 128"):
        script.quantize_1x128_transposed(torch.randn(100, 8))


def test_scaled_mm_accepts_the_blockwise_layout_on_meta_tensors():
    # The CPU has no FP8 GEMM; torch's meta kernel checks the shapes and strides cuBLASLt
    # needs (scale [C, M / 128] with stride [1, C] for both 1x128 operands).
    M, N, K = 1024, 256, 384
    dq = torch.empty(N, M, dtype=torch.float8_e4m3fn, device="meta")
    xq = torch.empty(K, M, dtype=torch.float8_e4m3fn, device="meta")
    di = torch.empty(M // 128, N, device="meta").t()
    xi = torch.empty(M // 128, K, device="meta").t()
    out = script.wgrad_blockwise(dq, di, xq, xi)
    assert out.shape == (N, K) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="1x128"):
        script.wgrad_blockwise(dq, di.contiguous(), xq, xi)  # row-major scales: refused


def test_rescued_sites_are_the_ones_only_blockwise_brings_within_budget():
    rows = [
        {"site": "a", "pass": "wgrad", "budget": 0.09, script.ROW: 0.29, script.TENSOR: 0.31,
         script.BLOCK: 0.05},
        {"site": "b", "pass": "wgrad", "budget": 0.09, script.ROW: 0.05, script.BLOCK: 0.04},
        {"site": "c", "pass": "dgrad", "budget": 0.09, script.ROW: 0.2, script.BLOCK: 0.1},
    ]  # fmt: skip
    assert script.rescued(rows) == ["a/wgrad"]
    recipes = script.probe_recipes()
    assert script.BLOCK in recipes["wgrad"] and script.BLOCK in recipes["dgrad"]


def test_accuracy_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    assert script.main(["--model", "dhen", "--preset", "tiny", "--steps", "3", "--rows", "256",
                        "--out", str(tmp_path)]) == 0  # fmt: skip
    (path,) = tmp_path.glob("blockwise_wgrad_*.json")
    record = json.loads(path.read_text())
    assert record["timings"] == [] and record["errors"]
    passes = {(r["pass"]) for r in record["errors"]}
    assert passes == {"dgrad", "wgrad"}
    assert all(script.BLOCK in r and script.ROW in r for r in record["errors"])
    # The whole batch's wgrad operands of every linear, the exact errors of both ways.
    full = record["full_batch"]
    assert len(full) == 8  # auto: the 8 sites with the most wgrad work
    assert full and all(r["M"] > 0 and 0 < r["block"] < 1 and 0 < r["row"] < 1 for r in full)
    # Probe's statistic three ways: whole batch, the sample's own, estimated from the sample.
    for r in full:
        assert r["rows"] == min(256, r["M"])
        assert all(0 < r[k] < 1 for k in ("row_balanced", "row_balanced_sample",
                                         "row_balanced_estimate"))  # fmt: skip
        if r["rows"] == r["M"]:  # nothing sampled: all three the same GEMM
            assert r["row_balanced_estimate"] == r["row_balanced_sample"] == r["row_balanced"]


def test_probe_statistics_estimate_the_whole_batch_from_a_sample():
    """A gradient that adds up over the tokens: the sample's own error is ~sqrt(M / m) the
    whole batch's, the estimate from the same sample is near the whole batch's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    dy = 2 * x @ (torch.randn(64, 96, generator=g) / 8) + torch.randn(4096, 96, generator=g)
    r = script.probe_statistics(x, dy, rows=256)
    assert r["row_balanced_sample"] > 2.5 * r["row_balanced"]
    assert r["row_balanced_estimate"] == pytest.approx(r["row_balanced"], rel=0.25)


def test_whole_batch_errors_pad_the_tokens_and_favour_blocks_on_drifting_magnitudes():
    torch.manual_seed(0)
    spread = torch.tensor([100.0**b for b in range(4)]).repeat_interleave(100)  # M = 400
    x, dy = torch.randn(400, 24) / spread[:, None], torch.randn(400, 16) * spread[:, None]
    errors = script.wgrad_errors(x, dy)
    assert errors["M"] == 400  # padded to 512 inside, reported as captured
    assert errors["block"] < 0.1 < errors["row"]


def test_capture_names_the_sites_with_the_most_wgrad_work_or_a_pattern():
    import polars as pl

    sites = pl.DataFrame([
        {"site": "a.fc1", "kind": "linear", "K": 64, "N": 64, "M_p50": 10},
        {"site": "a.fc2", "kind": "linear", "K": 128, "N": 64, "M_p50": 10},
        {"site": "b.fc1", "kind": "linear", "K": 32, "N": 32, "M_p50": 1000},
        {"site": "bag", "kind": "embedding", "K": 1000, "N": 1000, "M_p50": 1000},
    ])  # fmt: skip
    assert script.capture_names(sites, "auto", top=2) == ["b.fc1", "a.fc2"]
    assert script.capture_names(sites, "a.*") == ["a.fc1", "a.fc2"]
