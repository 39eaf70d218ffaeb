"""The README's examples run as written: the opening one (train, save, load, fit from a
LoRA) and the sign-GEMMs' (under the Triton interpreter)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_opening_example_runs(capsys):
    assert "from loka.lordba import" in BLOCKS[0]
    exec(compile(BLOCKS[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.startswith("rho_A ") and "predicted" in out
    assert "10.7x smaller than fp16 LoRA (8.0x with q)" in out


def test_sign_gemm_example_runs(capsys):
    (block,) = [b for b in BLOCKS if "sign_down(" in b]
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "torch.Size([32, 8]) torch.Size([32, 100]) ['triton.sign_up', 'torch.sign_up']" in out
