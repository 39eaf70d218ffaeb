"""A missing optional package gives one line naming the extra that installs it (issue 18).

Missing packages are simulated with `sys.modules[name] = None`, which makes importing them
fail exactly as when they are not installed."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from loka.dispatch.cli import main
from loka.dispatch.extras import MissingExtraError, explain, install_hint, require


def _one_error_line(capsys) -> str:
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out
    assert "Traceback" not in out.out + out.err
    return lines[0]


def test_demo_without_zoo_names_the_demo_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "loka.zoo", None)
    rc = main(["demo", "--out", str(tmp_path / "demo"), "--warmup-steps", "1", "--steps", "0"])
    assert rc == 1
    assert _one_error_line(capsys) == (
        "error: loka demo needs loka-zoo: pip install 'loka-dispatch[demo]'"
    )


def test_bench_zoo_large_without_zoo_names_the_zoo_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "loka.zoo", None)
    rc = main(["bench", "--zoo-large", "--out", str(tmp_path / "kb.parquet")])
    assert rc == 1
    assert _one_error_line(capsys).endswith("needs loka-zoo: pip install 'loka-dispatch[zoo]'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("command", [["bench", "--shapes", "128x128x128"], ["probe", "dlrm"]])
def test_device_cuda_on_a_cpu_machine_is_one_line(capsys, tmp_path, command):
    rc = main([*command, "--device", "cuda", "--out", str(tmp_path / "out")])
    assert rc == 1
    assert _one_error_line(capsys) == (
        "error: --device cuda: no CUDA GPU is available here (use --device cpu)"
    )


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("loka.dispatch.integrations.lightning", "lightning", "lightning"),
        ("loka.dispatch.integrations.hf", "transformers", "hf"),
    ],
)
def test_trainer_integrations_without_their_framework(monkeypatch, module, blocked, extra):
    monkeypatch.setitem(sys.modules, blocked, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtraError, match=rf"pip install 'loka-dispatch\[{extra}\]'$"):
        importlib.import_module(module)
    monkeypatch.delitem(sys.modules, module, raising=False)  # not left half-imported


def test_session_without_probe_names_the_probe_extra(monkeypatch):
    from loka.dispatch.integrations.session import Session

    monkeypatch.setitem(sys.modules, "loka.probe", None)
    with pytest.raises(
        MissingExtraError, match=r"loka-probe: pip install 'loka-dispatch\[probe\]'"
    ):
        Session(torch.nn.Sequential(torch.nn.Linear(16, 16)))


def test_extras_named_in_messages_are_declared():
    from importlib.metadata import metadata

    from loka.dispatch.extras import OPTIONAL

    declared = set(metadata("loka-dispatch").get_all("Provides-Extra") or [])
    assert {extra for _, extra in OPTIONAL.values()} | {"demo"} <= declared


def test_explain_ignores_modules_that_are_not_optional():
    assert explain(ModuleNotFoundError("no", name="numpy"), "x") is None
    assert "loka-dispatch[hf]" in install_hint("peft.tuners", "x")
    assert require("json", "x") is importlib.import_module("json")
