"""The README's opening example (FP8 mods) runs as written."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_opening_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert "from loka.mods import Fp8LinearConfig" in blocks[0]
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "fuse_norm" in out and "fp8" in out  # the report lists the changes
    assert out.strip().endswith("Linear torch.Size([64, 32])")  # undone: nn.Linear again
