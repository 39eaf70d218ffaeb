"""The loka commands (probe, bench, plan, report, demo) on the CPU, their bad-input
messages, and the report's self-containment."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re

import polars as pl
import pytest

from loka.dispatch.cli import main
from loka.dispatch.report import FIGURES
from loka.dispatch.tables import read_plan
from loka.schema import SCHEMA_VERSION, read_table, write_table


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "probe"
    assert main(["probe", "wukong", "--steps", "3", "--batch-size", "64", "--out", str(out)]) == 0
    return out


def test_probe_bench_plan_report_from_the_command_line(probed, tmp_path, capsys) -> None:
    assert {p.name for p in probed.iterdir()} == {
        "sites.parquet", "tensor_stats.parquet", "site_errors.parquet"
    }  # fmt: skip
    kb, plan, html = tmp_path / "kb.parquet", tmp_path / "plan.parquet", tmp_path / "r.html"
    assert main(["bench", "--tables", str(probed), "--out", str(kb)]) == 0
    bench = read_table(kb, "kernel_bench")
    assert bench.height > 0 and bench["estimated"].all()
    assert main(["plan", "--tables", str(probed), "--kernel-bench", str(kb), "--out", str(plan),
                 "--show", "all", "--gemm-share", "0.4"]) == 0  # fmt: skip
    saved = read_plan(plan)
    sites = read_table(probed / "sites.parquet", "sites")
    assert set(saved.table["site"]) == set(sites["site"]) and saved.table.height == 3 * sites.height
    assert saved.summary.gemm_share == 0.4 and saved.summary.estimated
    assert main(["report", "--tables", str(probed), "--plan", str(plan), "--kernel-bench", str(kb),
                 "--out", str(html)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "ESTIMATED" in text and "wrote" in text
    assert_self_contained(html.read_text())
    assert oct(html.stat().st_mode & 0o777) == "0o644"


def assert_self_contained(page: str) -> None:
    """One file: no script, stylesheet, image, font or frame fetched from anywhere."""
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for pattern in (r"<script", r"<link", r"<img", r"<iframe", r"@import", r"url\((?!#)",
                    r"src\s*=", r"href\s*=\s*[\"'](?!#)"):  # fmt: skip
        assert not re.search(pattern, page, re.I), pattern
    # The only URLs are XML namespace names inside the inline SVGs, never fetched.
    urls = set(re.findall(r"https?://[^\"'\s<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    for fig_id in FIGURES:
        block = re.search(rf'<figure id="{fig_id}">(.*?)</figure>', page, re.S)
        assert block is not None and "<svg" in block.group(1) and "</svg>" in block.group(1), fig_id
    assert "<table>" in page and "ESTIMATED" in page


def test_bad_input_is_a_message_not_a_traceback(probed, tmp_path, capsys) -> None:
    assert main(["plan", "--tables", str(tmp_path / "nowhere")]) == 1
    assert "no probe tables folder" in capsys.readouterr().out
    assert main(["bench", "--shapes", "8192x1024", "--out", str(tmp_path / "kb.parquet")]) == 1
    assert "not MxKxN" in capsys.readouterr().out
    # A kernel_bench written by a future LoKA (another schema version).
    kb = tmp_path / "kb.parquet"
    assert main(["bench", "--shapes", "8192x1024x4096", "--out", str(kb)]) == 0
    # (rewritten here by polars, so without loka-schema's checksum of the bytes)
    footer = {**pl.read_parquet_metadata(kb), "loka.schema_version": str(SCHEMA_VERSION + 1)}
    footer.pop("loka.checksum")
    pl.read_parquet(kb).write_parquet(kb, metadata=footer)
    capsys.readouterr()
    assert main(["plan", "--tables", str(probed), "--kernel-bench", str(kb)]) == 1
    out = capsys.readouterr().out
    assert (
        f"schema version {SCHEMA_VERSION + 1}" in out and f"reads version {SCHEMA_VERSION}" in out
    )
    # A kernel_bench holding two machines' rows.
    good = read_table(probed / "sites.parquet", "sites")  # any table: wrong kind for plan
    write_table(good, tmp_path / "sites_as_bench.parquet", "sites")
    assert main(["plan", "--tables", str(probed), "--kernel-bench",
                 str(tmp_path / "sites_as_bench.parquet")]) == 1  # fmt: skip
    assert "holds table 'sites', expected 'kernel_bench'" in capsys.readouterr().out
    assert main(["demo", "--steps", "-1"]) == 1
    assert main([]) == 2


def test_demo_on_the_cpu_plans_for_the_h200_and_says_it_is_an_estimate(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--model", "dhen", "--warmup-steps", "3", "--steps", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "LoKA demo" in text and "NVIDIA H200" in text
    assert "ESTIMATED" in text and "not measured" in text
    assert "eval logloss" in text and "report:" in text
    plan = read_plan(out / "plan.parquet")
    assert plan.summary.estimated and plan.summary.device == "NVIDIA H200"
    assert_self_contained((out / "report.html").read_text())


def test_demo_trains_a_model_with_sparse_tables_with_the_zoos_optimizer(
    tmp_path, capsys, monkeypatch
) -> None:
    """The xl presets' tables take sparse gradients, which AdamW refuses: the demo trains
    with the zoo's optimizer (row-wise Adagrad on those tables)."""
    import loka.zoo as zoo

    create = zoo.create
    monkeypatch.setattr(zoo, "create", lambda *a, **k: create(*a, **k, sparse_embeddings=True))
    out = tmp_path / "demo"
    assert main(["demo", "--model", "dhen", "--warmup-steps", "2", "--steps", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    assert "LoKA demo" in capsys.readouterr().out


def test_demo_compile_trains_the_compiled_model_with_a_compiled_plan(
    tmp_path, capsys, monkeypatch
) -> None:
    import torch

    compile_ = torch.compile
    compiled: list = []

    def eager_compile(model, **kwargs):  # the "eager" backend: the same path, no codegen
        compiled.append(model)
        return compile_(model, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    out = tmp_path / "demo"
    assert main(["demo", "--model", "dhen", "--warmup-steps", "2", "--steps", "1", "--compile",
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert len(compiled) == 1 and "LoKA demo" in text
    plan = read_plan(out / "plan.parquet")
    backends = set(plan.table["backend"]) - {"torch.bf16"}
    assert backends <= {"torch.native", "torch.native.fast"}  # traceable only
    assert "mode='compiled'" in plan.metadata["config"]
    # On a GPU a compiled demo's warm-up runs eagerly: the speedup it prints is
    # verification's, or none.
    from types import SimpleNamespace

    from loka.dispatch.demo import DemoResult, _print

    result = DemoResult(plan, out, "cuda", {}, {}, [], compiled=True)
    _print(result, SimpleNamespace(events=[]))
    assert "not measured (nothing in FP8 to verify" in capsys.readouterr().out
    plan.summary.measured_speedup = 1.1
    _print(result, SimpleNamespace(events=[]))
    assert "1.100x, verification's" in capsys.readouterr().out
