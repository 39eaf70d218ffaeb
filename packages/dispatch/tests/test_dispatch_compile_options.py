"""compile_options: torch.compile's settings for a planned model (compiled and run on a
planned model by test_dispatch_readme)."""

from __future__ import annotations

import pytest

from loka.dispatch import compile_options


def test_each_mode_keeps_its_own_settings_and_adds_multi_kernel_reductions():
    assert compile_options() == {"triton.multi_kernel": 1}
    assert compile_options("reduce-overhead") == {
        "triton.cudagraphs": True,
        "triton.multi_kernel": 1,
    }
    assert compile_options("max-autotune")["max_autotune"] is True
    with pytest.raises(ValueError, match="mode must be one of default, reduce-overhead"):
        compile_options("fast")
