"""bench/e2e_table.py: issue 14's end-to-end table assembled from recorded realized.py runs."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

e2e_table = harness.load("e2e_table")


def run(commit: str, rows: list[dict], preset: str = "large") -> dict:
    return {"meta": {"git_commit": commit, "preset": preset}, "runs": rows}


def row(model, mode, variant, ms=None, **extra) -> dict:
    key = "fwd_ms" if variant.startswith("infer-") else "step_ms"
    return {"model": model, "mode": mode, "variant": variant, "preset": "large",
            **({key: ms} if ms is not None else {}), **extra}  # fmt: skip


def test_speedup_is_against_the_median_of_the_runs_own_seeds():
    data = run("a" * 40, [
        row("dhen", "compiled", "bf16", 30.0, speedup_vs_bf16=1.0),
        row("dhen", "compiled", "bf16-seed1", 33.0, speedup_vs_bf16=30.0 / 33.0),
        row("dhen", "compiled", "bf16-seed2", 31.0, speedup_vs_bf16=30.0 / 31.0),
        row("dhen", "compiled", "bf16@attention=math", 20.0),  # not a seed: options
        row("dhen", "compiled", "loka", 25.0, speedup_vs_bf16=1.2, predicted_speedup=1.1,
            ceiling=1.3, demoted={"fc": "slower"}, quality_ok=True, ratio_min=1.15,
            ratio_max=1.25, fp8_layers=3),
        row("dhen", "eager", "bf16", 40.0),
        row("dhen", "eager", "loka", 50.0),
        row("dhen", "compiled", "infer-bf16", 10.0, batch_size=16384),
        row("dhen", "compiled", "infer-loka", 8.0, batch_size=16384),
        row("dhen", "compiled", "infer-bf16", 40.0, batch_size=65536),
        row("dhen", "compiled", "infer-loka", 20.0, batch_size=65536),
    ])  # fmt: skip
    table = e2e_table.assemble([("realized_1.json", data)], "large", ("dhen",))
    got = {(r["mode"], r["variant"], r.get("batch_size")): r for r in table["runs"]}
    loka = got[("compiled", "loka", None)]
    assert loka["speedup_vs_bf16"] == pytest.approx(31.0 / 25.0)  # median of 30, 33, 31
    assert loka["speedup_vs_bf16_seed0"] == 1.2 and loka["quality_ok"] is True
    assert loka["predicted_speedup"] == 1.1 and loka["demoted"] == {"fc": "slower"}
    assert loka["source"] == "realized_1.json" and loka["commit"] == "aaaaaaa"
    assert got[("eager", "loka", None)]["speedup_vs_bf16"] == pytest.approx(0.8)
    assert got[("compiled", "infer-loka", 16384)]["speedup_vs_bf16"] == pytest.approx(1.25)
    assert got[("compiled", "infer-loka", 65536)]["speedup_vs_bf16"] == pytest.approx(2.0)
    assert "quality_ok" in got[("compiled", "bf16", None)]  # None: no band trained
    assert "dhen/cudagraphs/bf16" in table["missing"]
    assert "dhen/compiled/loka" not in table["missing"]
    assert table["no_quality"] == ["dhen/eager"]
    lines = e2e_table.markdown(table).splitlines()
    assert lines[0].startswith("| model | mode |") and len(lines) == 2 + 2  # compiled, eager
    compiled = next(line for line in lines if line.startswith("| dhen | compiled |"))
    # seed 0's figures as timed, the seeds' median beside LoKA's
    assert "30.00 ms, 0.909x / 0.968x | not run | 1.200x [1.150, 1.250] (3) |" in compiled
    assert f"| {31.0 / 25.0:.3f}x |" in compiled and "| 1.100x / - |" in compiled
    assert compiled.endswith("| 1.300x / - | - |")  # no quality draw


def test_the_latest_run_wins_but_an_untimed_row_keeps_a_timed_one():
    early = run("1" * 40, [row("hstu", "compiled", "bf16", 24.0),
                           row("hstu", "compiled", "loka", 23.0)])  # fmt: skip
    late = run("2" * 40, [row("hstu", "compiled", "bf16", 23.0),
                          row("hstu", "compiled", "loka", 22.0),
                          row("hstu", "cudagraphs", "bf16"),  # budget-cut: no outcome
                          row("hstu", "cudagraphs", "torchao-tensorwise-auto",
                              error="RuntimeError: K not a multiple of 16")])  # fmt: skip
    latest = run("3" * 40, [row("hstu", "compiled", "loka"),  # untimed, no outcome
                            row("hstu", "compiled", "bf16", 25.0),  # a serving run's weights
                            row("hstu", "compiled", "infer-bf16", 7.0, batch_size=256)])  # fmt: skip
    table = e2e_table.assemble(
        [("realized_3.json", latest), ("realized_1.json", early), ("realized_2.json", late)],
        "large", ("hstu",))  # fmt: skip
    got = {(r["mode"], r["variant"]): r for r in table["runs"]}
    assert got[("compiled", "loka")]["step_ms"] == 22.0
    assert got[("compiled", "loka")]["source"] == "realized_2.json"
    assert got[("compiled", "bf16")]["step_ms"] == 23.0  # the A/B run's, not bf16 timed alone
    assert got[("compiled", "infer-bf16")]["source"] == "realized_3.json"
    assert got[("cudagraphs", "torchao-tensorwise-auto")]["error"].startswith("RuntimeError")
    assert "hstu/cudagraphs/torchao-tensorwise-auto" not in table["missing"]


def test_other_presets_and_rows_without_a_variant_are_left_out():
    data = run("4" * 40, [row("dhen", "compiled", "bf16", 30.0),
                          {"model": "dhen", "mode": "compiled", "error": "MemoryError"},
                          {**row("dhen", "compiled", "loka", 20.0), "preset": "xl"}])  # fmt: skip
    table = e2e_table.assemble([("r.json", data)], "large", ("dhen",))
    assert [r["variant"] for r in table["runs"]] == ["bf16"]


def test_reads_json_and_xz_and_names_a_file_that_is_not_a_run(tmp_path, capsys):
    data = run("5" * 40, [row("wukong", "eager", "bf16", 45.0),
                          row("wukong", "eager", "loka", 45.0)])  # fmt: skip
    (tmp_path / "realized_a.json.xz").write_bytes(lzma.compress(json.dumps(data).encode()))
    assert e2e_table.read_run(tmp_path / "realized_a.json.xz") == data
    bad = tmp_path / "realized_b.json"
    bad.write_text('{"meta": {}}')
    with pytest.raises(ValueError, match=r"realized_b\.json: no 'runs' list"):
        e2e_table.read_run(bad)
    out = tmp_path / "out"
    assert e2e_table.main([str(bad), "--out", str(out)]) == 2
    assert "realized_b.json" in capsys.readouterr().err and not out.exists()
    assert e2e_table.main([str(tmp_path / "realized_a.json.xz"), "--out", str(out),
                           "--models", "wukong"]) == 0  # fmt: skip
    (path,) = out.glob("e2e_*.json")
    written = json.loads(path.read_text())
    assert written["meta"]["sources"] == ["realized_a.json.xz"]
    assert [r["variant"] for r in written["runs"]] == ["bf16", "loka"]
    assert "wukong/compiled/bf16" in written["missing"]


def test_every_quality_draw_counts_and_one_outside_the_band_fails_the_cell():
    band = {"quality_band": [0.80, 0.81]}
    timed = run("6" * 40, [row("dhen", "compiled", "bf16", 30.0),
                           row("dhen", "compiled", "loka", 29.0)])  # fmt: skip
    first = run("7" * 40, [
        row("dhen", "compiled", "loka", quality=0.85, quality_ok=False, seed=0,
            quality_vs_own_seed=0.04, **band),
        row("dhen", "compiled", "bf16", quality=0.81, quality_ok=True, seed=0, **band),
    ])  # fmt: skip
    second = run("8" * 40, [
        row("dhen", "compiled", "loka", quality=0.805, quality_ok=True, seed=0, **band),
        row("dhen", "compiled", "loka@seed=1", quality=0.80, quality_ok=True, seed=1,
            quality_vs_own_seed=-0.002, **band),
    ])  # fmt: skip
    runs = [("realized_1.json", timed), ("realized_2.json", first), ("realized_3.json", second)]
    table = e2e_table.assemble(runs, "large", ("dhen",))
    got = {(r["mode"], r["variant"]): r for r in table["runs"]}
    assert ("compiled", "loka@seed=1") not in got  # a draw of loka, not a cell
    loka = got[("compiled", "loka")]
    assert loka["step_ms"] == 29.0 and loka["source"] == "realized_1.json"  # timing kept
    assert [(d["seed"], d["quality"], d["source"]) for d in loka["quality_draws"]] == [
        (0, 0.85, "realized_2.json"), (0, 0.805, "realized_3.json"),
        (1, 0.80, "realized_3.json")]  # fmt: skip
    assert loka["quality_ok"] is False  # the first draw fell outside its band
    assert table["no_quality"] == []
    assert e2e_table.markdown(table).splitlines()[-1].endswith("| 2 of 3 in band |")
    table = e2e_table.assemble(runs[:1] + runs[2:], "large", ("dhen",))
    assert {(r["variant"]): r for r in table["runs"]}["loka"]["quality_ok"] is True


def test_variants_run_with_options_are_filed_under_the_tables_name(tmp_path, capsys):
    data = run("9" * 40, [
        row("dhen", "compiled", "bf16", 30.0),
        row("dhen", "compiled", "loka+mk", 26.0),
        row("dhen", "compiled", "infer-bf16", 10.0, batch_size=65536),
        row("dhen", "compiled", "infer-loka", 8.0, batch_size=65536),
        row("dhen", "compiled", "infer-loka+static=2", 7.0, batch_size=65536),
    ], preset="xl")  # fmt: skip
    for r in data["runs"]:
        r["preset"] = "xl"
    rename = e2e_table.renames(["loka+mk:loka", "infer-loka:infer-loka-dynamic",
                                "infer-loka+static=2:infer-loka"])  # fmt: skip
    table = e2e_table.assemble([("realized_x.json", data)], "xl", ("dhen",), rename)
    got = {(r["variant"], r.get("batch_size")): r for r in table["runs"]}
    assert got[("loka", None)]["variant_as_run"] == "loka+mk"
    assert got[("loka", None)]["speedup_vs_bf16"] == pytest.approx(30.0 / 26.0)
    assert got[("infer-loka", 65536)]["fwd_ms"] == 7.0  # static scales, as named
    assert got[("infer-loka-dynamic", 65536)]["fwd_ms"] == 8.0
    assert "dhen/compiled/loka" not in table["missing"]
    for bad in (["loka+mk"], ["a:b", "a:c"], [":loka"]):
        with pytest.raises(ValueError, match="--rename"):
            e2e_table.renames(bad)
    path = tmp_path / "realized_x.json"
    path.write_text(json.dumps(data))
    assert e2e_table.main([str(path), "--preset", "xl", "--rename", "nope", "--out",
                           str(tmp_path / "out")]) == 2  # fmt: skip
    assert "expected AS_RUN:NAME" in capsys.readouterr().err


def test_serving_rows_make_a_table_of_their_own():
    data = run("a" * 40, [
        row("dhen", "compiled", "bf16", 30.0),
        row("dhen", "compiled", "infer-bf16", 10.0, batch_size=16384),
        row("dhen", "compiled", "infer-loka", 8.0, batch_size=16384, speedup_vs_bf16=1.25,
            ratio_min=1.2, ratio_max=1.3, fp8_layers=4, demoted={"fc": "slower"},
            predicted_from_step=1.2, ceiling_step=1.4),
        row("dhen", "compiled", "infer-bf16", 40.0, batch_size=65536),
        row("dhen", "compiled", "infer-loka", 20.0, batch_size=65536, speedup_vs_bf16=2.0,
            predicted_from_step=1.5, ceiling_step=1.6, serving_estimated=True),
        row("dhen", "compiled", "infer-torchao-rowwise", batch_size=65536,
            error="RuntimeError: shapes"),
    ])  # fmt: skip
    table = e2e_table.assemble([("realized_1.json", data)], "large", ("dhen",))
    lines = e2e_table.serving_markdown(table).splitlines()
    assert lines[0].startswith("| model | mode | batch |") and len(lines) == 2 + 2
    assert lines[2] == ("| dhen | compiled | 16384 | 10.00 ms | loka 1.250x [1.200, 1.300] "
                        "(4; 1 demoted) | 1.200x / 1.400x |")  # fmt: skip
    assert "loka 2.000x" in lines[3] and "torchao-rowwise: RuntimeError: shapes" in lines[3]
    assert lines[3].endswith("| 1.500x / 1.600x (estimated) |")
    assert e2e_table.serving_markdown({"runs": [row("dhen", "compiled", "bf16", 1.0)]}) == ""
