"""bench/center_quality.py: which linears it swaps and how, and one short run per variant."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("center_quality")


def test_only_the_named_forwards_run_in_fp8_plain_or_centered(tmp_path):
    import loka.zoo as zoo
    from loka.mods import Fp8Linear

    setup = zoo.create("dhen", "tiny")
    names = script.convert(setup.model, ["blocks.*"], script.RECIPES["center"])
    assert names and all(n.startswith("blocks.") for n in names)
    modules = dict(setup.model.named_modules())
    for name, module in modules.items():
        assert isinstance(module, Fp8Linear) == (name in names)
    config = modules[names[0]].fp8_config
    assert config.fwd.recipe.center and config.dgrad.is_bf16 and config.wgrad.is_bf16
    # --pass dgrad: the same swap with the gradient's GEMM in FP8 instead
    setup = zoo.create("dhen", "tiny")
    names = script.convert(setup.model, ["blocks.*"], script.RECIPES["plain"], "dgrad")
    config = setup.model.get_submodule(names[0]).fp8_config
    assert config.fwd.is_bf16 and not config.dgrad.is_bf16 and config.wgrad.is_bf16
    script.main(["--preset", "tiny", "--steps", "2", "--seeds", "0", "--eval-batches", "1",
                 "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("center_quality_*.json")
    runs = json.loads(path.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["bf16", "plain", "center"]
    assert runs[0]["fp8_sites"] == [] and runs[1]["fp8_sites"] == runs[2]["fp8_sites"] != []
