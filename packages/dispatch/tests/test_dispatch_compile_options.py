"""compile_options and choose_compile_options: torch.compile's settings for a planned model
(compiled and run on a planned model by test_dispatch_readme)."""

from __future__ import annotations

import pytest
import torch

from loka.dispatch import compile_options
from loka.dispatch.compile_options import choose_compile_options


def test_each_mode_keeps_its_own_settings_and_adds_multi_kernel_reductions():
    multi = {"triton.multi_kernel": 1, "fx_graph_cache": False}
    assert compile_options() == multi
    assert compile_options("reduce-overhead") == {"triton.cudagraphs": True, **multi}
    assert compile_options("reduce-overhead", multi_kernel=False) == {"triton.cudagraphs": True}
    assert compile_options(multi_kernel=False) == {}
    assert compile_options("max-autotune")["max_autotune"] is True
    with pytest.raises(ValueError, match="mode must be one of default, reduce-overhead"):
        compile_options("fast")


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="multi-kernel reductions are compiled for a GPU"
)
def test_a_multi_kernel_graph_compiled_again_does_not_fail() -> None:
    """The second compile of the same graph would load it from inductor's FX graph cache,
    which fails for multi-kernel graphs on torch 2.11 / Triton 3.6."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.GELU()).cuda()
    x = torch.randn(2048, 512, device="cuda")
    outputs = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(model, options=compile_options())
        out = compiled(x)
        out.float().square().mean().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[0], outputs[1])


class StepCostTimer:
    """A timer whose step time is whatever the last step reported (a fake clock)."""

    def __init__(self) -> None:
        self.cost = 0.0
        self.times: list[float] = []

    def start(self) -> None:
        self.times = []

    def mark(self) -> None:
        self.times.append(self.cost)

    def collect(self) -> list[float]:
        times, self.times = self.times, []
        return times


def fake_choice(costs: dict[bool, list[float]], **kwargs):
    """choose_compile_options over a stand-in compile whose runs cost `costs[multi_kernel]`
    seconds per step, cycling (so the blocks differ as on a noisy GPU)."""
    timer = StepCostTimer()
    compiled_with: list[dict] = []
    calls = {True: 0, False: 0}

    def fake_compile(model, options):
        compiled_with.append(options)
        multi = "triton.multi_kernel" in options
        return lambda: multi

    def step(run):
        multi = run()
        timer.cost = costs[multi][calls[multi] % len(costs[multi])]
        calls[multi] += 1

    model = torch.nn.Linear(2, 2)
    choice = choose_compile_options(model, step, timer=timer, compile=fake_compile, **kwargs)
    return choice, compiled_with, calls


def test_multi_kernel_is_kept_only_where_it_is_faster_with_confidence():
    faster, compiled_with, calls = fake_choice({True: [0.9, 0.92], False: [1.0, 1.01]})
    assert compiled_with == [{"triton.multi_kernel": 1, "fx_graph_cache": False}, {}]
    assert faster.multi_kernel and faster.options == compile_options()
    assert faster.compiled() is True  # the run compiled with multi-kernel
    assert faster.speedup == pytest.approx(1.005 / 0.91, rel=0.02)
    assert faster.low > 1.0
    # warm-up 3 + 4 blocks x 5 steps, each way
    assert calls == {True: 23, False: 23}
    assert "multi-kernel reductions" in faster.line() and "4 block pairs" in faster.line()

    slower, *_ = fake_choice({True: [1.05, 1.06], False: [1.0, 1.01]})
    assert not slower.multi_kernel and slower.options == {}
    assert slower.compiled() is False
    assert slower.speedup < 1.0 and "the default mode's settings" in slower.line()

    # a gain inside the noise keeps the mode's settings (no extra compile time later)
    noisy, *_ = fake_choice({True: [0.9, 1.1, 1.0], False: [1.0, 0.95, 1.06]}, blocks=3)
    assert not noisy.multi_kernel and noisy.low <= 1.0


def test_too_few_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="blocks >= 2"):
        fake_choice({True: [1.0], False: [1.0]}, blocks=1)


def test_a_real_compile_on_the_cpu_trains_under_the_chosen_options():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    before = model[0].weight.detach().clone()

    def step(run):
        loss = torch.nn.functional.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from torch._dynamo.utils import counters

    counters.clear()
    choice = choose_compile_options(model, step, blocks=2, steps_per_block=2, warmup_steps=1)
    # one graph per setting, compiled in warm-up: switching between them recompiles nothing
    assert counters["stats"]["unique_graphs"] == 2
    assert set(choice.step_ms) == {"multi-kernel", "mode"}
    assert all(len(v) == 2 and min(v) > 0 for v in choice.step_ms.values())
    assert choice.options == compile_options(multi_kernel=choice.multi_kernel)
    assert not torch.equal(model[0].weight, before)  # the timed steps were training steps
    out = choice.compiled(x)
    assert out.shape == (64, 1) and torch.allclose(out, model(x), atol=1e-5)
