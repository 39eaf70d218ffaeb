"""Eager CUDA graphs of Fp8Linear's quantizations (`loka.mods.eager_graphs`): a graphed
module computes exactly what the ungraphed one does, replays only where its inputs sit where
they did at capture, and never replays over memory a pending backward reads.

On the CPU the graph is `ReplayGraph`, which does what a CUDA graph does to memory: nothing
at capture, and at each replay the captured function again on the captured inputs' storage,
written into the same output tensors. The real capture runs where there is a GPU."""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch
from torch import nn

from loka.mods import eager_graphs
from loka.mods.config import Fp8LinearConfig
from loka.mods.eager_graphs import EagerGraphs
from loka.mods.fp8_linear import Fp8Linear, release_eager_graphs

DELAYED = Fp8LinearConfig.from_recipes(
    "e4m3:e4m3/tensor/delayed3", "e5m2:e4m3/tensor/delayed3", "e5m2:e4m3/tensor/delayed3"
)
CONFIGS = {"row": Fp8LinearConfig(), "tensor-delayed": DELAYED}


def _tree(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        made = [_tree(v, fn) for v in value]
        return type(value)(*made) if hasattr(value, "_fields") else type(value)(made)
    return value


def _copy_into(target, source) -> None:
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, tuple | list):
        for t, s in zip(target, source, strict=True):
            _copy_into(t, s)


class ReplayGraph:
    """A CPU stand-in for a captured torch.cuda.CUDAGraph (see the module docstring)."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args
        # The capture runs nothing: the output structure comes from a run on copies.
        dry = fn(*(_tree(a, torch.clone) for a in args))
        self.outputs = _tree(dry, lambda t: torch.full_like(t, float("nan"))
                             if t.is_floating_point() else torch.zeros_like(t))  # fmt: skip

    def replay(self) -> None:
        _copy_into(self.outputs, self.fn(*self.args))


def replay_capture(fn, args):
    graph = ReplayGraph(fn, args)
    return graph, graph.outputs


def graphed(module: Fp8Linear, **kw) -> Fp8Linear:
    module.eager_graphs = EagerGraphs(capture=replay_capture, cuda_only=False, **kw)
    return module


def pair(config: Fp8LinearConfig, K=64, N=32, seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(K, N)
    plain = Fp8Linear.from_linear(copy.deepcopy(base), config.replace(eager_graphs=False))
    return graphed(Fp8Linear.from_linear(base, config)), plain


def train_steps(module, x, dy, steps):
    """Per step: output, input grad, weight grad; an SGD step between (the weight's FP8
    copies are re-made every step)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        xi = x.detach().requires_grad_(True)
        y = module(xi)
        y.backward(dy)
        out.append((y.detach().clone(), xi.grad.clone(), module.weight.grad.clone()))
        opt.step()
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graphed_training_equals_eager(name):
    module, plain = pair(CONFIGS[name])
    x, dy = torch.randn(24, 64), torch.randn(24, 32) * 1e-2
    x.requires_grad_(False)
    got = train_steps(module, x, dy, 5)
    want = train_steps(plain, x, dy, 5)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(g, w, strict=True):
            assert torch.equal(a, b), f"step {step}"
    stats = module.eager_graphs.stats
    # input, grad and weight layouts: seen at step 1, captured at 2, replayed from 3 on.
    assert stats.captures == 3 and stats.replays == 9, stats
    assert stats.eager == {"first sight": 3}
    if name == "tensor-delayed":  # the history pushes ran at every replay, not at capture
        for buffer in ("amax_history_input", "amax_history_weight"):
            assert torch.equal(getattr(module, buffer), getattr(plain, buffer))


def test_a_new_address_runs_eagerly_then_is_captured():
    module, plain = pair(Fp8LinearConfig())
    dy = torch.randn(24, 32)
    xs = [torch.randn(24, 64) for _ in range(2)]
    for x in (xs[0], xs[0], xs[1], xs[1], xs[0], xs[1]):
        got = train_steps(module, x, dy, 1)[0]
        want = train_steps(plain, x, dy, 1)[0]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    graphs = module.eager_graphs
    assert graphs.stats.eager["first sight"] >= 2 and graphs.stats.replays >= 2
    # Past max_graphs a layout that comes twice replaces the least recently replayed one.
    full = graphed(Fp8Linear.from_linear(nn.Linear(64, 32)), max_graphs=1)
    for x in (xs[0], xs[0], xs[0], xs[1], xs[1], xs[1]):
        with torch.no_grad():
            want = Fp8Linear.from_linear(full.to_linear(), Fp8LinearConfig(eager_graphs=False))
            assert torch.equal(full(x), want(x))
    stats = full.eager_graphs.stats
    # x0 captured at its 2nd call, replayed at its 3rd; x1 the same, evicting x0 (the weight
    # never changed: quantized once, eagerly).
    assert (stats.captures, stats.evictions, stats.replays) == (2, 1, 2)
    assert len(full.eager_graphs) == 1
    # Layouts that never settle: after max_graphs evictions the role captures nothing new.
    churn = graphed(Fp8Linear.from_linear(nn.Linear(64, 32)), max_graphs=1)
    layouts = [torch.randn(24, 64) for _ in range(5)]
    for x in layouts:
        with torch.no_grad():
            churn(x), churn(x)
    stats = churn.eager_graphs.stats
    assert (stats.captures, stats.evictions) == (2, 1)
    assert stats.eager["layouts unsettled"] == 3
    # Once its graph has replayed SETTLED_REPLAYS times, the role may capture again.
    settled = torch.randn(24, 64)
    with torch.no_grad():
        for _ in range(eager_graphs.SETTLED_REPLAYS):
            churn(layouts[1])  # the layout captured last: replays
        churn(settled), churn(settled)
    assert (stats.captures, stats.evictions) == (3, 2)


def test_a_module_called_twice_before_its_backward_does_not_overwrite_saved_memory():
    """A shared layer: the second call runs eagerly while the first call's backward is due;
    the gradients are exactly the ungraphed module's."""
    module, plain = pair(Fp8LinearConfig())
    x1, x2 = torch.randn(24, 64), torch.randn(24, 64)
    dy = torch.randn(24, 32)

    def step(m):
        m.zero_grad()
        a, b = x1.detach().requires_grad_(True), x2.detach().requires_grad_(True)
        (m(a) * dy + m(b) * dy * 2).sum().backward()
        return a.grad.clone(), b.grad.clone(), m.weight.grad.clone()

    for _ in range(4):
        for g, w in zip(step(module), step(plain), strict=True):
            assert torch.equal(g, w)
    assert module.eager_graphs.stats.eager["backward pending"] >= 2
    assert module.eager_graphs.stats.replays > 0
    assert not module.eager_graphs.pending


def test_retained_backward_after_another_forward_raises():
    module, _ = pair(Fp8LinearConfig())
    x, dy = torch.randn(24, 64), torch.randn(24, 32)
    for _ in range(2):  # capture the input layout
        module(x.detach().requires_grad_(True)).backward(dy)
    y = module(x.detach().requires_grad_(True))
    y.backward(dy, retain_graph=True)
    module(x.detach().requires_grad_(True)).backward(dy)  # replays: overwrites saved x^T
    with pytest.raises(RuntimeError, match="retained graph"):
        y.backward(dy)


def test_a_failed_capture_warns_once_and_runs_eagerly():
    def broken(fn, args):
        raise RuntimeError("operation not permitted when stream is capturing")

    module, plain = pair(Fp8LinearConfig())
    module.eager_graphs = EagerGraphs(capture=broken, cuda_only=False)
    x, dy = torch.randn(24, 64), torch.randn(24, 32)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = train_steps(module, x, dy, 4)
    want = train_steps(plain, x, dy, 4)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert torch.equal(a, b)
    assert module.eager_graphs.stats.replays == 0
    assert module.eager_graphs.stats.eager["capture failed"] > 0


def test_copies_start_without_graphs_and_config_switches_them_off():
    module, _ = pair(Fp8LinearConfig())
    x, dy = torch.randn(24, 64), torch.randn(24, 32)
    train_steps(module, x, dy, 3)
    assert len(module.eager_graphs) == 3
    clone = copy.deepcopy(module)
    assert isinstance(clone.eager_graphs, EagerGraphs) and len(clone.eager_graphs) == 0
    model = nn.Sequential(module, nn.ReLU(), clone)
    assert release_eager_graphs(model) == 3 and len(module.eager_graphs) == 0
    off = Fp8Linear(64, 32, config=Fp8LinearConfig(eager_graphs=False))
    assert off.eager_graphs is None
    assert "no eager graphs" in str(off.fp8_config)
    with pytest.raises(TypeError, match="eager_graphs must be a bool"):
        Fp8LinearConfig(eager_graphs=1)
    # the torch-native backend has no eager quantization steps to graph
    native = Fp8Linear(64, 32, config=Fp8LinearConfig.from_recipes(backend="torch.native.cpu"))
    assert native.eager_graphs is None


def test_cpu_tensors_are_not_graphed_by_default():
    module = Fp8Linear(64, 32)
    train_steps(module, torch.randn(24, 64), torch.randn(24, 32), 3)
    assert len(module.eager_graphs) == 0 and module.eager_graphs.stats.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphed_training_equals_eager():
    torch.manual_seed(0)
    base = nn.Linear(256, 128).cuda()
    plain = Fp8Linear.from_linear(copy.deepcopy(base), Fp8LinearConfig(eager_graphs=False))
    module = Fp8Linear.from_linear(base, Fp8LinearConfig())
    x = torch.randn(64, 256, device="cuda")
    dy = torch.randn(64, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = train_steps(module, x, dy, 5)
        want = train_steps(plain, x, dy, 5)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert torch.equal(a, b)
    assert module.eager_graphs.stats.replays > 0
