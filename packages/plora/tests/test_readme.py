"""The README's examples run as written: the opening one (packed training of two jobs on a
tiny Llama) and the kernels' (forward and backward under the Triton interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_opening_example_trains_every_job():
    pytest.importorskip("transformers", reason="the example builds a Llama")
    assert "from loka.plora import" in BLOCKS[0]
    # As a user on a CPU runs it: no TRITON_INTERPRET, so the adapters take the loop backend
    # (the kernels' own example below runs them in the interpreter).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[0]], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = [line.split()[:3] for line in proc.stdout.splitlines()]
    assert jobs == [["r8-lr1e-3", "done", "4"], ["r4-lr3e-4", "done", "2"]]


def test_kernels_example_runs(capsys):
    (block,) = [b for b in BLOCKS if "multi_lora_linear(" in b]
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "torch.Size([144, 128]) torch.Size([28, 256])" in out
    assert "['triton.multi_lora', 'torch.multi_lora_loop']" in out
