"""bench/probe_budget.py: the GEMM errors it reads from a model, on the CPU (a tiny model)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import harness

script = harness.load("probe_budget")


def test_fewer_mantissa_bits_err_more_in_every_pass():
    import loka.zoo as zoo

    setup = zoo.create("dhen", "tiny", batch_size=64)
    batches = [next(setup.train_batches())]
    errors = {bits: script.gemm_errors(setup, batches, bits, bits, 0.0) for bits in (3, 1)}
    assert set(errors[3]) == set(errors[1]) and errors[3]
    for key, value in errors[3].items():
        assert 0 < value < errors[1][key], key
