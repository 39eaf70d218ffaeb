"""CLI errors are one line of text (never rich markup, never a traceback), exit status 1;
`loka lora-plan` refuses values no plan can be made with."""

from __future__ import annotations

import json
import stat

import pytest

from loka.dispatch.cli import main
from loka.dispatch.cli._common import fail

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


@pytest.mark.parametrize(
    "message", ["recipe e4m3:e4m3/row/dynamic[/pow2] is wrong", "[red]x", "a path /tmp/[/x]/y"]
)
def test_messages_are_printed_as_text_not_markup(capsys, message):
    assert fail(message) == 1
    assert _lines(capsys) == [f"error: {message}"]


def test_a_long_message_stays_on_one_line(capsys):
    fail("word " * 100)
    assert len(_lines(capsys)) == 1


def test_a_markup_like_path_is_named_literally(tmp_path, capsys):
    where = tmp_path / "[/pow2]" / "[red]x"
    assert main(["plan", "--tables", str(where)]) == 1
    (line,) = _lines(capsys)
    assert str(where) in line


def test_plan_out_a_directory_is_one_line(tmp_path, capsys):
    assert main(["plan", "--tables", str(tmp_path), "--out", str(tmp_path)]) == 1
    (line,) = _lines(capsys)
    assert "is a directory" in line and str(tmp_path) in line


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
