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

Multi-kernel does not pay on every model: HSTU xl's plan trained 1.061x bf16 with it
against 1.096-1.099x without (173.3 vs 166.0-166.5 ms, bf16 unchanged at 182-184 ms;
`realized_20261203T054359Z` against earlier runs: different days, bf16 in each process),
InterFormer xl's 1.030-1.043x against 1.051x. So
`choose_compile_options(model, step_fn)` measures it on the model's own training step:

    choice = choose_compile_options(model, lambda run: train_step(run, next(batches)))
    model_step = choice.compiled        # the model compiled under choice.options
    print(choice.line())                # what was measured and why

It compiles the model both ways, runs `step_fn` (one whole training step with the callable
it is given, optimizer included: these are real training steps) in interleaved blocks
(CUDA events) and keeps multi-kernel only where it is faster with confidence, else the
mode's own settings (torch's default, and no extra compile time on later recompiles).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loka.dispatch.step_timers import StepTimer

__all__ = ["CompileChoice", "choose_compile_options", "compile_options"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The two settings choose_compile_options times, in the order of its first block.
CANDIDATES = ("multi-kernel", "mode")


def compile_options(mode: str = "default", *, multi_kernel: bool = True) -> dict[str, Any]:
    """``options=`` for `torch.compile` of a model with a LoKA plan applied: `mode`'s
    inductor settings, plus multi-kernel reductions unless `multi_kernel` is False."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode))
    if multi_kernel:
        options["triton.multi_kernel"] = 1
        # torch 2.11 / Triton 3.6: a multi-kernel graph loaded from inductor's FX graph
        # cache fails (`TypeError: 'NoneType' object does not support the context manager
        # protocol` in Triton's JITFunction.cache_key): a recompile of a graph seen before
        # (Session's verification switching sites, DHEN xl on an H100) or a second run of
        # a script. Such graphs are compiled afresh instead.
        options["fx_graph_cache"] = False
    return options


@dataclass(frozen=True)
class CompileChoice:
    """What `choose_compile_options` measured and kept."""

    mode: str
    multi_kernel: bool  # kept: faster with confidence on the model's own step
    options: dict[str, Any]  # compile_options(mode, multi_kernel=multi_kernel)
    compiled: Callable[..., Any]  # the model compiled under `options`
    speedup: float  # step time without / with multi-kernel (medians of block medians)
    low: float  # the paired interval of that ratio at `confidence`
    high: float
    confidence: float
    step_ms: dict[str, list[float]]  # block medians, "multi-kernel" and "mode"

    def line(self) -> str:
        kept = (
            "multi-kernel reductions" if self.multi_kernel else f"the {self.mode} mode's settings"
        )
        return (
            f"compile: {kept} (multi-kernel {self.speedup:.3f}x the step without it, "
            f"{100 * self.confidence:.0f}% interval [{self.low:.3f}, {self.high:.3f}] over "
            f"{len(self.step_ms['mode'])} block pairs)"
        )


def choose_compile_options(
    model: Any,
    step_fn: Callable[[Callable[..., Any]], object],
    mode: str = "default",
    *,
    blocks: int = 4,
    steps_per_block: int = 5,
    warmup_steps: int = 3,
    confidence: float = 0.9,
    timer: StepTimer | None = None,
    compile: Callable[..., Any] | None = None,
) -> CompileChoice:
    """Compile `model` with and without multi-kernel reductions (`mode`'s settings either
    way), time `step_fn(compiled)` in interleaved blocks and keep the faster: multi-kernel
    only where its step is faster with `confidence`. `step_fn` runs one whole training step
    with the callable it is given; the model trains for
    ``2 * (warmup_steps + blocks * steps_per_block)`` steps. `timer`: a
    `loka.dispatch.step_timers.StepTimer` (default: CUDA events on a GPU model, the wall
    clock elsewhere); `compile`: `torch.compile` unless given (a test's stand-in). With
    ``mode="reduce-overhead"`` both compiled runs record CUDA graphs (count on memory for both;
    dynamo keeps the unchosen graph cached), and `step_fn` should begin with
    `torch.compiler.cudagraph_mark_step_begin()` as any training loop under it does."""
    import torch

    from loka.dispatch.step_timers import default_timer
    from loka.dispatch.verify_stats import compare

    if blocks < 2 or steps_per_block < 1 or warmup_steps < 1:
        raise ValueError(
            "choose_compile_options needs blocks >= 2 (for an interval), steps_per_block >= 1 "
            f"and warmup_steps >= 1; got {blocks}, {steps_per_block}, {warmup_steps}"
        )
    options = {
        "multi-kernel": compile_options(mode, multi_kernel=True),
        "mode": compile_options(mode, multi_kernel=False),
    }
    compile = compile or torch.compile
    runs = {name: compile(model, options=opts) for name, opts in options.items()}
    if timer is None:
        params = next(iter(model.parameters()), None)
        timer = default_timer(params.device if params is not None else "cpu")
    for run in runs.values():  # the first calls compile; none of them is timed
        for _ in range(warmup_steps):
            step_fn(run)
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(blocks):
        order = CANDIDATES if block % 2 == 0 else CANDIDATES[::-1]
        for name in order:
            timer.start()
            for _ in range(steps_per_block):
                step_fn(runs[name])
                timer.mark()
            times = timer.collect()
            if not times:
                raise RuntimeError(f"choose_compile_options: the timer gave no step times ({name})")
            medians[name].append(1e3 * statistics.median(times))
    measured = compare(medians["multi-kernel"], medians["mode"], confidence)
    keep = measured.low > 1.0
    chosen = "multi-kernel" if keep else "mode"
    return CompileChoice(
        mode=mode,
        multi_kernel=keep,
        options=options[chosen],
        compiled=runs[chosen],
        speedup=measured.speedup,
        low=measured.low,
        high=measured.high,
        confidence=confidence,
        step_ms=medians,
    )
