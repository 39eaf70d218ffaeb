"""bench/host_profile.py on the CPU: the native backend's run, and `--stub-device`, the GPU's
code path with its device work stubbed, restored afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

host_profile = harness.load("host_profile")


def test_stubbed_device_work_runs_the_gpu_path_on_the_cpu_and_restores_it():
    from loka.kernels import registry
    from loka.mods import Fp8Linear, Fp8LinearConfig, ops

    before = (registry.get("torch.scaled_mm"), ops.quantize_with, torch._scaled_mm)
    config = Fp8LinearConfig.from_recipes(*["e4m3:e4m3/row/dynamic"] * 3,
                                          backend="torch.scaled_mm")  # fmt: skip
    x = torch.randn(16, 32, requires_grad=True)
    with host_profile.stubbed_device_work("torch.scaled_mm"):
        module = Fp8Linear(32, 48, config=config)
        y = module(x)
        y.sum().backward()
        assert y.shape == (16, 48) and x.grad.shape == (16, 32)
        assert module.weight.grad.shape == (48, 32)
    assert (registry.get("torch.scaled_mm"), ops.quantize_with, torch._scaled_mm) == before


def test_main_with_stub_device_records_the_gpu_backend(tmp_path):
    out = tmp_path / "out"
    assert host_profile.main(["--stub-device", "--graphs", "off", "--calls", "2", "--M", "16",
                              "--K", "32", "--N", "32", "--out", str(out)]) == 0  # fmt: skip
    (path,) = out.glob("host_profile_*.json")
    record = json.loads(path.read_text())
    assert record["meta"]["stub_device"] is True
    assert record["meta"]["backend"] == "torch.scaled_mm"
    rows = record["rows"]
    assert [r["passes"] for r in rows] == [["fwd"], ["dgrad"], ["wgrad"], ["fwd", "dgrad", "wgrad"]]
    assert all(r["backend"] == "torch.scaled_mm" and r["host_ms"] > 0 for r in rows)


def test_stub_device_does_not_combine_with_regional():
    with pytest.raises(SystemExit):
        host_profile.parse_args(["--stub-device", "--regional"])
