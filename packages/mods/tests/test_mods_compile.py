"""torch.compile: FP8 modules compile with fullgraph=True (no graph break in steady state)
and train exactly as in eager mode, weight-cache refreshes and delayed scaling included;
so does a zoo model with mods applied."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import copy

import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.mods import ModSpec, SiteMods, apply
from loka.mods.config import Fp8LinearConfig, PassConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.grouped import GroupedLinear, GroupLayout
from loka.mods.norm_linear import fuse_pair
from loka.zoo.layers import PerFeatureProjections

ROW = "e4m3:e4m3/row/dynamic"
DELAYED_PADDED = Fp8LinearConfig.from_recipes(
    "e4m3:e4m3/tensor/delayed4", "e5m2:e4m3/tensor/delayed4", "bf16", pad=True
)


def model():
    """LayerNorm fused into a rowwise FP8 linear, GELU, a delayed-scaling padded FP8 linear."""
    torch.manual_seed(0)
    fused_norm, norm_linear = fuse_pair(nn.LayerNorm(40), nn.Linear(40, 48), Fp8LinearConfig())
    return nn.Sequential(
        fused_norm, norm_linear, nn.GELU(), Fp8Linear(48, 24, config=DELAYED_PADDED)
    )


def test_compiled_training_matches_eager():
    torch._dynamo.reset()
    eager = model()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # each step changes the weights: the cache must follow in both
        x = torch.randn(20, 40, generator=g)
        for module, optimizer in zip((eager, compiled), optimizers, strict=True):
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        for a, b in zip(eager.parameters(), compiled_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    explained = torch._dynamo.explain(compiled_model)(torch.randn(20, 40))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def test_compiled_under_autocast():
    torch._dynamo.reset()
    module = Fp8Linear(32, 16, config=Fp8LinearConfig(ROW, "bf16", "bf16"))
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), module(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_zoo_model_with_mods_compiles_without_graph_breaks():
    torch._dynamo.reset()
    s = zoo.create("dhen", "tiny", batch_size=16)
    batch = next(s.train_batches())
    fwd_only = Fp8LinearConfig(ROW, "bf16", "bf16")
    sites = {
        "blocks.0.fc1": SiteMods(fp8=fwd_only, fuse_norm=True),
        "input_projection": SiteMods(fp8=fwd_only),
    }
    apply(s.model, ModSpec(sites=sites, auto_group=True), batch)
    compiled = torch.compile(s.model, fullgraph=True, backend="aot_eager")
    got = compiled(batch)
    got.sum().backward()
    got_grads = [p.grad.clone() for p in s.model.parameters()]
    s.model.zero_grad()
    want = s.model(batch)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, p in zip(got_grads, s.model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.explain(s.model)(batch).graph_break_count == 0


class SteadyModel(nn.Module):
    """Every FP8 module kind: a norm fused into a rowwise linear, a tensorwise dynamic
    linear, a delayed-scaling padded linear (all three passes delayed) and an FP8 group."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.fc1 = fuse_pair(nn.LayerNorm(32), nn.Linear(32, 32), Fp8LinearConfig())
        dynamic = Fp8LinearConfig.from_recipes(
            "e4m3:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic"
        )
        self.fc2 = Fp8Linear(32, 32, config=dynamic)
        delayed = Fp8LinearConfig.from_recipes(
            "e4m3:e4m3/tensor/delayed4", "e5m2:e4m3/tensor/delayed4",
            "e5m2:e4m3/tensor/delayed2", pad=True,
        )  # fmt: skip
        self.fc3 = Fp8Linear(32, 24, config=delayed)
        grouped = Fp8LinearConfig("e4m3:e4m3/row/dynamic", "e5m2:e4m3/row/dynamic", "bf16")
        self.heads = GroupedLinear(
            PerFeatureProjections(3, 8, 8), GroupLayout(), backend="fp8", config=grouped
        )

    def forward(self, x):
        h = nn.functional.gelu(self.fc1(self.norm(x)))
        h = self.fc3(nn.functional.gelu(self.fc2(h)))
        return self.heads(h.view(-1, 3, 8))


def test_no_recompile_after_the_first_training_step():
    """Step 1 compiles (forward and backward); later steps, with SGD and AdamW updates in
    between, the delayed histories filling and the weight caches refreshing, run the same
    graphs: any recompile raises."""
    torch._dynamo.reset()
    model = SteadyModel()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    params = list(model.parameters())
    half = len(params) // 2
    optimizers = [torch.optim.SGD(params[:half], lr=0.1), torch.optim.AdamW(params[half:])]
    g = torch.Generator().manual_seed(1)
    counters = torch._dynamo.utils.counters
    before = None
    try:
        for step in range(4):
            x = torch.randn(20, 32, generator=g)
            loss = compiled(x).square().mean()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            assert torch.isfinite(loss)
            if step == 0:
                before = dict(counters["stats"])
                torch._dynamo.config.error_on_recompile = True
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert dict(counters["stats"])["unique_graphs"] == before["unique_graphs"]
    assert float(model.fc3.amax_history_grad_output[1]) > 0  # the delayed path did run


def _native(*recipes: str) -> Fp8LinearConfig:
    return Fp8LinearConfig(
        *(PassConfig(r, "torch.native.cpu") if r != "bf16" else PassConfig(r) for r in recipes)
    )


class UpstreamThen(nn.Module):
    """An nn.Linear and SiLU feeding `inner`: gradients must reach the upstream weight."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        torch.manual_seed(1)
        self.up = nn.Linear(32, 32)
        self.inner = inner

    def forward(self, x):
        return self.inner(nn.functional.silu(self.up(x)))


AUTOCAST_MODELS = {
    "custom ops (norm-fused, tensor, delayed, grouped)": SteadyModel,
    "native, forward only": lambda: nn.Sequential(
        Fp8Linear(32, 32, config=_native(ROW, "bf16", "bf16")),
        nn.GELU(),
        Fp8Linear(32, 16, config=_native(ROW, "e5m2:e4m3/row/dynamic", ROW)),
    ),
}


@pytest.mark.parametrize("name", list(AUTOCAST_MODELS))
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_gradients_under_autocast_match_eager(name, backend):
    """Under torch.compile with bf16 autocast (how users train), every parameter, upstream
    ones included, gets the gradient eager mode gives. Regression: a no-op ``.to(dtype)`` on
    a function's output made torch 2.11 return zero gradients there, silently, and the
    'faster' compiled plans measured on the H200 were skipping backward work."""
    torch._dynamo.reset()
    eager = UpstreamThen(AUTOCAST_MODELS[name]())
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=backend)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    for module in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().square().mean().backward()
    for (pname, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        assert a.grad is not None and a.grad.abs().sum() > 0, pname
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=1e-5, msg=pname)
