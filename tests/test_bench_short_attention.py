"""bench/short_attention.py on the CPU: InterFormer tiny's attention modules timed in every
variant the CPU can run, the others recorded as errors, one JSON record."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

short_attention = harness.load("short_attention")  # importing it runs nothing


def test_inputs_keep_the_cls_tokens_valid_and_the_padding_zero():
    import loka.zoo as zoo

    config, _, _ = zoo.preset_config("interformer", "tiny")
    data = short_attention.inputs(config, 32, "cpu")
    valid, seq = data["valid"], data["seq"]
    assert valid.shape == (32, config.num_cls + config.max_seq_len)
    assert valid[:, : config.num_cls].all() and (valid.sum(1) > config.num_cls).all()
    assert (seq[~valid] == 0).all() and not valid.all()


def test_the_cpu_run_times_what_runs_here_and_records_what_does_not(tmp_path, capsys):
    short_attention.main(["--out", str(tmp_path), "--rounds", "1", "--batch", "32"])
    (path,) = tmp_path.glob("short_attention_*.json")
    record = json.loads(path.read_text())
    rows = {(r["variant"], r["module"]): r for r in record["rows"]}
    assert len(rows) == 2 * len(short_attention.variants())
    for part in ("sequence", "pooling"):
        assert rows[("sdpa", part)]["speedup_vs_sdpa"] == 1.0
        assert rows[("math", part)]["ms"] > 0 and "speedup_vs_sdpa" in rows[("math", part)]
        # cuDNN's kernels need a GPU: an error row, and the run goes on
        assert "No viable backend" in rows[("sdpa-cudnn_attention", part)]["error"]
    assert record["meta"]["preset"] == "tiny"
    assert "wrote" in capsys.readouterr().out


def test_each_forced_backend_is_traced_under_its_own_forcing(monkeypatch):
    # Dynamo does not guard on `sdpa_kernel`: compiled around the module, the first variant's
    # graph (cuDNN on the H200) served every forced one (`short_attention_20261204T185004Z`
    # timed them all alike). Each forced variant must compile a graph of its own, holding
    # the backend it forces.
    import functools

    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    import loka.zoo as zoo
    from loka.zoo.models.interformer import PoolingAttention

    forwards: list[list[str]] = []  # each forward graph's aten ops, where SDPA is lowered

    def recording(gm, example_inputs):
        forwards.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    monkeypatch.setattr(
        torch,
        "compile",
        functools.partial(
            torch.compile,
            backend=aot_autograd(
                fw_compiler=recording, bw_compiler=lambda gm, example_inputs: gm.forward
            ),
        ),
    )
    torch._dynamo.reset()
    counters.clear()
    config, _, _ = zoo.preset_config("interformer", "tiny")
    data = short_attention.inputs(config, 8, "cpu")
    for backend in ("MATH", "FLASH_ATTENTION"):
        torch.manual_seed(0)
        module = PoolingAttention(dataclasses.replace(config, attention="sdpa"))
        short_attention.module_step(module, "pooling", data, False, backend, compiled=True)()
    assert counters["stats"]["unique_graphs"] == 2
    math_graph, flash_graph = forwards
    assert any("flash_attention" in t for t in flash_graph)
    assert not any("flash_attention" in t for t in math_graph)
    assert any("softmax" in t for t in math_graph)
