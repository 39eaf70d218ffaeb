"""Helpers of the bad-input suite: run a `loka` command in-process and read what it said."""

from __future__ import annotations

import json

import pytest

MODEL = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
JOB = {"name": "a", "rank": 8, "alpha": 16, "lr": 1e-4, "batch_size": 2, "steps": 10}


@pytest.fixture
def loka(capsys):
    """`loka(*argv)` runs the CLI and asserts the bad-input contract: exit status 1, no
    traceback, exactly one error line and it is the last; returns that line."""
    from loka.dispatch.cli import main

    def run(*argv: str) -> str:
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        text = captured.out + captured.err
        lines = [line for line in text.splitlines() if line.strip()]
        assert code == 1, text
        assert "Traceback" not in text, text
        errors = [line for line in lines if line.startswith("error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], text
        return errors[0]

    return run


@pytest.fixture
def one_line():
    """`one_line(exc_info)`: the exception's message, asserted to be a single line."""

    def check(info) -> str:
        message = str(info.value)
        assert message and "\n" not in message, message
        return message

    return check


@pytest.fixture
def lora_model() -> dict:
    """A small valid model config (a fresh copy per test)."""
    return dict(MODEL)


@pytest.fixture
def lora_job() -> dict:
    """A valid LoRA job (a fresh copy per test)."""
    return dict(JOB)


@pytest.fixture
def lora_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    (tmp_path / "jobs.json").write_text(json.dumps([JOB, {**JOB, "name": "b", "rank": 16}]))
    return tmp_path
