"""CLI errors are one line of text (never rich markup, never a traceback), exit status 1."""

from __future__ import annotations

import pytest

from loka.dispatch.cli import main
from loka.dispatch.cli._common import fail


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
