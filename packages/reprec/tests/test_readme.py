"""The README's opening example (the injector and its soft tokens) runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_opening_example_runs(capsys):
    block = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
    assert "from loka.reprec import" in block
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip() == (
        "torch.Size([4, 18, 256]) [-100, -100, -100, -100, -100, -100, 0]"
    )
