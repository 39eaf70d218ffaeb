"""The README's serving example runs as written and serves with static input scales."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_serving_example_runs_with_static_scales(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (serving,) = [b for b in blocks if "calibrate_input_scales" in b]
    scope = {"__name__": "readme"}
    exec(compile(serving, str(README), "exec"), scope)
    applied = scope["applied"]
    assert applied.prequantized and set(applied.prequantized) == set(applied.sites)
    for site in applied.prequantized:
        assert applied.model.get_submodule(site).static_input_amax > 0
    assert "prequantized for serving" in capsys.readouterr().out
