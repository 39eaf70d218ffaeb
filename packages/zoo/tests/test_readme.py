"""The README's opening example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_opening_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert "import loka.zoo as zoo" in BLOCKS[0]
    exec(compile(BLOCKS[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    assert "'ne'" in out[0] and "'hr@10'" in out[1]
    assert out[2] == "sparse-rowwise-adagrad"
    share, gigabytes = map(float, out[3].split())
    assert share > 0.55 and gigabytes < 0.8 * 141
