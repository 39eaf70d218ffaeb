"""`loka lora-plan`, found by the `loka` command (loka-dispatch) through this package's entry
point: it writes the schedule, and bad input is one line naming it, exit status 1."""

from __future__ import annotations

import json
import stat
import sys

import polars as pl
import pytest

main = pytest.importorskip("loka.dispatch.cli", reason="the `loka` command is loka-dispatch's").main

MODEL = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
JOB = {"name": "a", "rank": 8, "alpha": 16, "lr": 1e-4, "batch_size": 2, "steps": 10}


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def test_the_subcommand_comes_from_this_package():
    from loka.dispatch.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert commands["lora-plan"].get_default("loka_package") == "loka-plora"


def test_cli_writes_the_schedule_and_fails_on_a_job_that_cannot_fit(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 24,
                "hidden_size": 1536,
                "intermediate_size": 4096,
                "vocab_size": 32000,
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
            }
        )
    )
    jobs = [
        {
            "name": f"j{n}",
            "rank": 8 * (1 + n % 3),
            "alpha": 16,
            "lr": 1e-4,
            "batch_size": 1 + n % 4,
            "steps": 100,
        }
        for n in range(6)
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    out = tmp_path / "plan" / "schedule.csv"
    args = ["lora-plan", str(tmp_path / "jobs.json"), "--model", str(tmp_path), "--gpus", "2"]
    assert main([*args, "--gpu-memory", "80GiB", "--out", str(out)]) == 0
    schedule = pl.read_csv(out)
    assert sorted(schedule["job"]) == [j["name"] for j in jobs]
    assert set(schedule["status"]) == {"planned"}
    assert "analytic estimate" in capsys.readouterr().err
    (tmp_path / "jobs.json").write_text(
        json.dumps([*jobs, {**jobs[0], "name": "huge", "batch_size": 4096}])
    )
    assert main([*args, "--gpu-memory", "80GiB"]) == 1
    assert "huge does not fit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--gpu-memory", "eighty"])


@pytest.fixture
def files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    (tmp_path / "jobs.json").write_text(json.dumps([JOB]))
    return tmp_path


def _lora(files, *extra, jobs="jobs.json", model=None):
    return [
        "lora-plan", str(files / jobs), "--model", str(model or files), "--gpu-memory", "80GiB",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--gpu-memory", "0"), "--gpu-memory must be a positive size"),
        (("--max-pack-size", "0"), "--max-pack-size must be at least 1"),
        (("--time-limit", "-1"), "--time-limit must be a positive number"),
        (("--time-limit", "nan"), "--time-limit must be a positive number"),
        (("--gpus", "0"), "--gpus must be in"),
        (("--headroom", "1.5"), "--headroom is a fraction"),
        (("--seq-len", "0"), "--seq-len must be in"),
        (("--out", "schedule.txt"), "written as .csv, .parquet or .json"),
        (("--compile",), "--compile times compiled steps and needs --profile"),
    ],
)
def test_lora_plan_range_checks(files, capsys, extra, needle):
    assert main(_lora(files, *extra)) == 1
    (line,) = _lines(capsys)
    assert needle in line


def test_lora_plan_bad_files_are_one_line_naming_the_file(files, capsys):
    (files / "big.json").write_text(json.dumps([{**JOB, "batch_size": 10**12}]))
    assert main(_lora(files, jobs="big.json")) == 1
    (line,) = _lines(capsys)
    assert "big.json" in line and "tokens per step" in line
    (files / "bad.json").write_text('[{"name": "a",')
    assert main(_lora(files, jobs="bad.json")) == 1
    (line,) = _lines(capsys)
    assert "bad.json: malformed JSON" in line
    zero = files / "zero"
    zero.mkdir()
    (zero / "config.json").write_text(json.dumps({**MODEL, "num_attention_heads": 0}))
    assert main(_lora(files, model=zero)) == 1
    (line,) = _lines(capsys)
    assert "config.json" in line and "num_attention_heads" in line


def test_lora_plan_memory_beyond_any_gpu_is_a_usage_error(files, capsys):
    with pytest.raises(SystemExit) as info:
        main(_lora(files, "--gpu-memory", "1e400"))
    assert info.value.code == 2
    assert "more than 1 PiB" in _lines(capsys)[-1]


def test_the_schedule_gets_an_ordinary_files_mode(files, capsys):
    out = files / "schedule.csv"
    assert main(_lora(files, "--out", str(out))) == 0
    ordinary = files / "ordinary"
    ordinary.write_text("")
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode)


def test_yaml_jobs_without_pyyaml_name_the_yaml_extra(monkeypatch, capsys, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("- {name: a, rank: 8}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    rc = main(["lora-plan", str(jobs), "--model", "gpt2"])
    assert rc == 1
    (line,) = _lines(capsys)
    assert line == "error: reading jobs.yaml (YAML) needs PyYAML: pip install 'loka-plora[yaml]'"


def test_jobs_with_their_own_lengths_plan_from_a_csv(files, capsys):
    rows = ["name,rank,alpha,lr,batch_size,steps,seq_len"]
    rows += [f"s{n},8,16,0.0001,4,50,128" for n in range(2)] + ["l0,8,16,0.0001,2,50,"]
    (files / "jobs.csv").write_text("\n".join(rows) + "\n")
    out = files / "schedule.csv"
    assert main(_lora(files, "--seq-len", "256", "--out", str(out), jobs="jobs.csv")) == 0
    schedule = pl.read_csv(out).sort("job")
    assert schedule["seq_len"].to_list() == [256, 128, 128]  # l0 takes --seq-len
    assert schedule["job_tokens"].to_list() == [50 * 2 * 256, 50 * 4 * 128, 50 * 4 * 128]
    capsys.readouterr()
    (files / "long.csv").write_text(rows[0] + "\na,8,16,0.0001,4096,5,1048576\n")
    assert main(_lora(files, jobs="long.csv")) == 1
    (line,) = _lines(capsys)
    assert "batch_size 4096 x seq_len 1048576" in line and "tokens per step" in line
