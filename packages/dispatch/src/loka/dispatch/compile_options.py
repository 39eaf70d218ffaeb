"""The `torch.compile` settings a planned model runs fastest under.

    model = torch.compile(model, options=compile_options())           # the default mode
    model = torch.compile(model, options=compile_options("reduce-overhead"))

What they add to torch.compile's mode: inductor's multi-kernel (``triton.multi_kernel``),
which compiles each reduction both looped and persistent and keeps the faster at run time.
A compiled FP8 linear quantizes its input rowwise in the kernel of the activation before
it; over a row of 4096 inductor's static choice is the looped form, which reads each row
twice: GELU + rowwise quantization of 16384 x 4096 took 0.218 ms looped and 0.129 ms
persistent on the H200 (GELU alone 0.101 ms). In place, DHEN xl trained 1.080x -> 1.141x
bf16 and served 1.135x -> 1.299x (B = 16384), with bf16 unchanged (30.10 / 29.96 ms);
Wukong xl, whose quantizations follow LayerNorms, trained the same, served 1.17x -> 1.20x
(`bench/results/realized_20261203T031309Z`, `..031721Z`). The cost: compile time, LoKA's
DHEN training graph 40 -> 52 s.

torch.compile takes a mode or options, not both: `compile_options(mode)` carries the
mode's own settings (`torch._inductor.list_mode_options`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["compile_options"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(mode: str = "default") -> dict[str, Any]:
    """``options=`` for `torch.compile` of a model with a LoKA plan applied: `mode`'s
    inductor settings plus multi-kernel reductions."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    from torch._inductor import list_mode_options

    return {**list_mode_options(mode), "triton.multi_kernel": 1}
