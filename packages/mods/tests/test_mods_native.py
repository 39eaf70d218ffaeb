"""The torch-native backend (``torch.native``): quantization bit-identical to the reference,
every pass equal to `fp8_linear_reference` up to the bf16 rounding of the GEMM output, and
a native model compiles with no graph break and no recompile over training steps."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels

import pytest
import torch
from torch import nn

from loka.kernels import registry
from loka.kernels.native import quantize_native
from loka.kernels.quantization import quantize_reference
from loka.mods.config import Fp8LinearConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.native_function import NativePlan
from loka.mods.reference import fp8_linear_reference
from loka.schema import QuantConfig

NATIVE = "torch.native"


def native_config(fwd, dgrad, wgrad) -> Fp8LinearConfig:
    return Fp8LinearConfig.from_recipes(fwd, dgrad, wgrad, backend=NATIVE)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("options", [(False, None), (True, None), (False, 2.0)])
def test_quantize_native_is_the_reference_bit_for_bit(granularity, fmt, transpose, options):
    pow2, ub = options
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 80, generator=g) * torch.logspace(-3, 3, 80)
    x[5, 7], x[9, 1], x[11] = float("inf"), float("nan"), 0.0  # amax ignores both; a zero row
    data, inv = quantize_native(x, fmt, granularity, pow2=pow2, scale_ub=ub, transpose=transpose)
    source = x.t().contiguous() if transpose else x
    ref = quantize_reference(source, QuantConfig(fmt, granularity, None, pow2, ub))
    assert data.shape == source.shape and data.is_contiguous()
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(inv.reshape(-1), ref.inv_scale.reshape(-1))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("options", [(False, None), (True, None), (False, 2.0)])
def test_the_formulation_traced_for_inductor_is_the_eager_one_bit_for_bit(
    granularity, transpose, options
):
    # Under torch.compile quantize_native traces the graph inductor fused well (the eager
    # path's leaner ops made it fuse HSTU's SiLU-backward quantization into a slower
    # looped reduction); both must give the reference's bits.
    from loka.kernels.native import _quantize_traced

    pow2, ub = options
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(40, 64, generator=g) * torch.logspace(-4, 4, 64)).bfloat16()
    x[3, 5], x[7, 1], x[9] = float("inf"), float("nan"), 0.0
    x[4, 4] = 1e30  # saturates after a scale_ub
    for fmt in ("e4m3", "e5m2"):
        for rows_vary in (False, True):
            data, scale = _quantize_traced(x, fmt, granularity, pow2, ub, transpose, rows_vary)
            want, want_inv = quantize_native(x, fmt, granularity, pow2=pow2, scale_ub=ub)
            if transpose and granularity == "row":
                want, want_inv = quantize_native(
                    x, fmt, granularity, pow2=pow2, scale_ub=ub, transpose=True
                )
                want, want_inv = want.t(), want_inv.t()
            assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(scale.reciprocal().reshape(-1), want_inv.reshape(-1))
    # the static-scale cast of a served input, traced the same way
    from loka.kernels.native import _saturate_traced, saturate_cast_native

    static = torch.tensor(3.0)
    assert torch.equal(_saturate_traced(x, static, "e4m3").view(torch.uint8),
                       saturate_cast_native(x, static, "e4m3").view(torch.uint8))  # fmt: skip


def test_token_rows_take_the_tensor_amax_in_two_stages_under_compile_same_bits():
    # Jagged batches make M symbolic; inductor reduces a symbolic dim 2x slower, so token
    # rows are reduced over their static columns first. Same bits as the reference; eager
    # keeps the single reduction (one launch fewer).
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm

    def amax_dims(gm):
        return [n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
                for n in gm.graph.nodes if n.target == "amax"]  # fmt: skip

    g = torch.Generator().manual_seed(4)
    for rows_vary in (True, False):
        graphs.clear()
        torch._dynamo.reset()
        fn = torch.compile(quantize_native, backend=capture, dynamic=True)
        for m in (48, 37):
            x = torch.randn(m, 80, generator=g) * torch.logspace(-3, 3, 80)
            x[5, 7], x[9, 1] = float("inf"), float("nan")
            data, inv = fn(x, "e4m3", "tensor", transpose=True, rows_vary=rows_vary)
            ref = quantize_reference(x.t().contiguous(), QuantConfig("e4m3", "tensor"))
            assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(inv.reshape(-1), ref.inv_scale.reshape(-1))
        dims = [d for gm in graphs for d in amax_dims(gm)]
        assert dims == ([1, None] if rows_vary else [None]), dims
        # the formulation written for inductor, not the eager path's (no nan_to_num)
        targets = {str(n.target) for gm in graphs for n in gm.graph.nodes}
        assert not any("nan_to_num" in t for t in targets), targets
    eager = quantize_native(x, "e4m3", "tensor", rows_vary=True)
    assert torch.equal(eager[1], quantize_native(x, "e4m3", "tensor")[1])


def test_eager_quantization_creates_no_tensor_from_host_data_and_stays_short():
    # Eager FP8 passes pay host time per op (an FP8 linear's fwd + bwd cost 0.6-1.0 ms of
    # host on the H200 against nn.Linear's 0.31): a scale from torch.tensor(v, device=...)
    # copied from the host on every call, and the saturation took four ops for a clamp's one
    # (24 ops per operand then, 14 after). Two more since: an infinite input becomes NaN
    # (`isinf`, `masked_fill_`) instead of saturating, so that an fp16 overflow reaches
    # GradScaler (16 now).
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(64, 128, dtype=torch.bfloat16)
    for granularity, scale_ub in (("row", None), ("tensor", 2.0)):
        with Ops() as ops:
            quantize_native(x, "e4m3", granularity, scale_ub=scale_ub)
        assert "lift_fresh" not in ops.seen, ops.seen
        assert sum(ops.seen.values()) <= 16, ops.seen


RECIPES = [
    ("e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic", "e4m3:e4m3/row/dynamic"),
    ("e4m3:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic", "e5m2:e4m3/tensor/dynamic"),
    ("e4m3:e4m3/tensor/dynamic/pow2", "bf16", "e5m2:e4m3/row/dynamic"),
    ("bf16", "e4m3:e4m3/row/dynamic", "bf16"),
]


@pytest.mark.parametrize("recipes", RECIPES)
def test_native_linear_matches_the_reference(recipes):
    config = native_config(*recipes)
    g = torch.Generator().manual_seed(0)
    module = Fp8Linear(64, 32, bias=False, config=config)
    x = torch.randn(48, 64, generator=g, requires_grad=True)
    dy = torch.randn(48, 32, generator=g)
    y = module(x)
    y.backward(dy)
    ref = fp8_linear_reference(x.detach(), module.weight.detach(), config, dy)
    # The GEMM writes bf16: within its rounding of the float32 reference.
    tol = {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(y, ref.y.to(y.dtype), **tol)
    torch.testing.assert_close(x.grad, ref.dx, **tol)
    torch.testing.assert_close(module.weight.grad, ref.dw, **tol)


def test_native_linear_with_bias_under_autocast_gives_bf16():
    module = Fp8Linear(32, 16, config=native_config("e4m3:e4m3/row/dynamic", "bf16", "bf16"))
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    want = nn.functional.linear(x, module.weight, module.bias)
    assert (y.float() - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("backend", [NATIVE, "torch.native.cpu"])
def test_float32_input_under_autocast_is_quantized_as_its_autocast_cast(backend):
    # A LayerNorm under autocast hands the linear float32: the FP8 passes quantize the bf16
    # cast nn.Linear would multiply (what Probe measured), and the input gradient comes back
    # in float32 as autocast's cast returns it.
    recipe = "e4m3:e4m3/row/dynamic"
    config = Fp8LinearConfig.from_recipes(recipe, recipe, recipe, backend=backend)
    module = Fp8Linear(32, 16, config=config)
    x = torch.randn(16, 32, requires_grad=True)
    xb = x.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yb = module(x), module(xb)
    assert torch.equal(y, yb)
    y.float().sum().backward()
    yb.float().sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xb.grad.float())


@pytest.mark.parametrize("recipes", RECIPES[:3])
def test_unaligned_shapes_run_in_fp8_padded_exactly_as_the_reference(recipes):
    # M = 13 (wgrad contracts it), K = 30, N = 7: _scaled_mm needs multiples of 16, so the
    # native linear zero-pads the operands and slices the results: the same products as
    # the unpadded FP8 reference, every pass in FP8 (InterFormer xl's fc1 has K = 7507;
    # jagged batches have any M).
    config = native_config(*recipes)
    g = torch.Generator().manual_seed(2)
    module = Fp8Linear(30, 7, config=config)
    x = torch.randn(13, 30, generator=g, requires_grad=True)
    dy = torch.randn(13, 7, generator=g)
    y = module(x)
    y.backward(dy)
    assert y.shape == (13, 7) and x.grad.shape == (13, 30) and module.weight.grad.shape == (7, 30)
    ref = fp8_linear_reference(x.detach(), module.weight.detach(), config, dy)
    tol = {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(y, (ref.y + module.bias.detach()).to(y.dtype), **tol)
    torch.testing.assert_close(x.grad, ref.dx, **tol)
    torch.testing.assert_close(module.weight.grad, ref.dw, **tol)
    torch.testing.assert_close(module.bias.grad, dy.sum(0))
    exact = dy.t() @ x.detach()
    if not config.wgrad.is_bf16:
        assert not torch.allclose(module.weight.grad, exact, rtol=1e-5, atol=1e-6)  # FP8


@pytest.mark.parametrize("recipe", ["e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic"])
def test_a_dynamic_batch_is_padded_without_a_guard_on_its_alignment(recipe):
    # A compiled linear whose batch size varies (jagged batches): one dynamic graph for
    # every M, aligned or not, each in FP8.
    import torch._dynamo.testing

    config = native_config(recipe, recipe, recipe)
    module = Fp8Linear(32, 16, bias=False, config=config)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(module, backend=counter, dynamic=True)
    for m in (16, 13, 32, 21):
        x = torch.randn(m, 32, requires_grad=True)
        dy = torch.randn(m, 16)
        module.weight.grad = None
        compiled(x).backward(dy)
        ref = fp8_linear_reference(x.detach(), module.weight.detach(), config, dy)
        torch.testing.assert_close(module.weight.grad, ref.dw, rtol=2**-7, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("recipes", RECIPES[:2])
def test_native_cpu_runs_unaligned_shapes_in_fp8_as_the_reference(recipes):
    # torch.native.cpu (the CPU emulation of loka.dispatch.apply): every shape in FP8, as
    # the Triton kernels would run it; torch.native would run these passes in high precision.
    config = Fp8LinearConfig.from_recipes(*recipes, backend="torch.native.cpu")
    g = torch.Generator().manual_seed(1)
    module = Fp8Linear(13, 7, bias=False, config=config)
    assert module.native_plan.any_shape
    x = torch.randn(11, 13, generator=g, requires_grad=True)
    dy = torch.randn(11, 7, generator=g)
    y = module(x)
    y.backward(dy)
    ref = fp8_linear_reference(x.detach(), module.weight.detach(), config, dy)
    tol = {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(y, ref.y.to(y.dtype), **tol)
    torch.testing.assert_close(x.grad, ref.dx, **tol)
    torch.testing.assert_close(module.weight.grad, ref.dw, **tol)
    exact = (x.detach() @ module.weight.detach().t()).to(y.dtype)
    assert not torch.equal(y.detach(), exact)  # quantized, not high precision
    cpu_only = registry.get("torch.native.cpu")
    assert cpu_only.runnable_reason("cpu") is None and cpu_only.unavailable_reason("cpu")


def test_native_config_is_checked_before_anything_changes():
    with pytest.raises(ValueError, match="every FP8 pass"):
        NativePlan.of(
            Fp8LinearConfig(
                fwd=("e4m3:e4m3/row/dynamic"),
                dgrad=Fp8LinearConfig.from_recipes(backend="torch.scaled_mm").dgrad,
                wgrad=native_config("bf16", "bf16", "e4m3:e4m3/row/dynamic").wgrad,
            )
        )
    with pytest.raises(ValueError, match="delayed scaling"):
        NativePlan.of(native_config("e4m3:e4m3/tensor/delayed4", "bf16", "bf16"))
    with pytest.raises(ValueError, match="granularity"):
        NativePlan.of(native_config("e4m3:e4m3/block/dynamic", "bf16", "bf16"))


def test_backend_is_registered_traceable_and_refuses_what_it_cannot_run():
    backend = registry.get(NATIVE)
    assert backend.traceable and backend.runs_on_cpu
    from loka.schema import Recipe

    assert backend.supports(Recipe.parse("e4m3:e4m3/row/dynamic"), 128, 64, 32) is None
    assert "delayed" in backend.supports(Recipe.parse("e4m3:e4m3/tensor/delayed16"), 128, 64, 32)
    # A native linear pads its GEMMs (any shape); its GEMM alone still needs aligned dims.
    assert backend.linear_pads
    assert backend.supports(Recipe.parse("e4m3:e4m3/row/dynamic"), 13, 7507, 30, "wgrad") is None
    from loka.kernels.registry import GemmSpec

    spec = GemmSpec.for_linear(Recipe.parse("e4m3:e4m3/row/dynamic"), "fwd", 128, 60, 32)
    assert "multiple of 16" in backend.refuse(spec)


def test_fast_accumulation_variant_mixes_with_native_and_flags_only_its_passes():
    fast = registry.get("torch.native.fast")
    assert fast.traceable and fast.name.endswith(".fast")  # planned only when allowed
    plain = native_config("e4m3:e4m3/row/dynamic", "e4m3:e4m3/tensor/dynamic", "bf16")
    config = Fp8LinearConfig(
        fwd=Fp8LinearConfig.from_recipes(
            "e4m3:e4m3/row/dynamic", "bf16", "bf16", backend="torch.native.fast"
        ).fwd,
        dgrad=plain.dgrad,
        wgrad=plain.wgrad,
    )
    plan = NativePlan.of(config)
    assert plan.fwd.fast_accum and not plan.dgrad.fast_accum and plan.wgrad is None
    assert not NativePlan.of(plain).fwd.fast_accum
    with pytest.raises(ValueError, match="every FP8 pass"):
        NativePlan.of(
            Fp8LinearConfig(
                fwd=config.fwd,
                dgrad=Fp8LinearConfig.from_recipes(backend="torch.scaled_mm").dgrad,
                wgrad=plain.wgrad,
            )
        )
    # On the CPU the GEMM is emulated in float32: the fast flag changes nothing there.
    torch.manual_seed(0)
    module = nn.Linear(64, 32)
    x = torch.randn(48, 64)
    y_fast = Fp8Linear.from_linear(module, config)(x)
    y_plain = Fp8Linear.from_linear(module, plain)(x)
    torch.testing.assert_close(y_fast, y_plain, rtol=0, atol=0)


def test_compiled_native_training_has_no_graph_break_and_no_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    row = native_config(*RECIPES[0])
    tensor = native_config(*RECIPES[1])
    model = nn.Sequential(
        nn.LayerNorm(64), Fp8Linear(64, 96, config=row), nn.GELU(),
        Fp8Linear(96, 32, config=tensor),
    )  # fmt: skip
    eager = __import__("copy").deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    g = torch.Generator().manual_seed(1)

    def train_step(x):
        for module, optimizer in zip((compiled, eager), optimizers, strict=True):
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train_step(torch.randn(32, 64, generator=g))
    frames = dict(torch._dynamo.utils.counters["frames"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            train_step(torch.randn(32, 64, generator=g))
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    explained = torch._dynamo.explain(model)(torch.randn(32, 64))
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("shape", [(13, 8), (3, 5, 8)])
def test_bias_gradient_as_a_gemm_is_the_sum(shape):
    from loka.mods.bias_grad import bias_gradient

    dy = torch.randn(*shape, dtype=torch.float64)
    want = dy.sum(dy.dim() - 2)
    torch.testing.assert_close(bias_gradient(dy, "sum"), want)
    torch.testing.assert_close(bias_gradient(dy, "gemm"), want)
    torch.testing.assert_close(bias_gradient(dy, "split"), want)  # eager: the plain sum
    with pytest.raises(ValueError, match="bias_grad must be one of"):
        bias_gradient(dy, "mean")
    with pytest.raises(ValueError, match="bias_grad must be one of"):
        Fp8LinearConfig(bias_grad="mean")


@pytest.mark.parametrize("shape", [(300, 8), (512, 8), (7, 8), (3, 600, 8)])
def test_bias_gradient_split_in_blocks_is_the_sum_compiled(shape):
    from loka.mods.bias_grad import SPLIT_ROWS, bias_gradient

    torch._dynamo.reset()  # static shapes: another M seen before would make this one symbolic
    dy = torch.randn(*shape, dtype=torch.float64)
    seen = []

    def capture(gm, inputs):
        seen.append({str(n.target) for n in gm.graph.nodes})
        return gm

    split = torch.compile(lambda t: bias_gradient(t, "split"), backend=capture, fullgraph=True)
    got = split(dy)
    torch.testing.assert_close(got, dy.sum(dy.dim() - 2))
    assert got.dtype == dy.dtype
    # Two sums (blocks, then over them); a pad only where M is not a multiple of the block.
    assert sum("sum" in t for t in seen[0]) >= 1 and any("pad" in t for t in seen[0]) == bool(
        shape[-2] % SPLIT_ROWS
    )


def test_bias_gradient_split_traces_a_symbolic_token_count_without_guards():
    from loka.mods.bias_grad import bias_gradient

    frames = []

    def capture(gm, inputs):
        frames.append(gm)
        return gm

    split = torch.compile(lambda t: bias_gradient(t, "split"), backend=capture, dynamic=True)
    for m in (300, 513, 256, 40):  # padded, padded, exact, shorter than a block
        dy = torch.randn(m, 8, dtype=torch.float64)
        torch.testing.assert_close(split(dy), dy.sum(0))
    assert len(frames) == 1  # one graph for every M


@pytest.mark.parametrize("recipes", RECIPES[:2])
def test_native_linear_takes_its_bias_gradient_either_way_compiled(recipes):
    # Jagged batches compile with M symbolic; the GEMM and split forms must trace there too.
    config = native_config(*recipes)
    grads = {}
    for form in ("sum", "gemm", "split"):
        torch.manual_seed(0)
        module = Fp8Linear(32, 16, config=config.replace(bias_grad=form))
        compiled = torch.compile(module, backend="aot_eager", dynamic=True)
        for m in (16, 21):
            x = torch.randn(m, 32)
            module.zero_grad()
            compiled(x).square().sum().backward()
        grads[form] = module.bias.grad
    torch.testing.assert_close(grads["gemm"], grads["sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads["split"], grads["sum"], rtol=1e-5, atol=1e-5)


def test_a_linear_whose_tokens_vary_takes_two_stage_tensor_amaxes_of_its_activations():
    # Fp8LinearConfig.tokens_vary (set by loka.dispatch.apply for jagged sites): x's tensor
    # amax per row, then over rows; the weight's in one reduction; without it, one each.
    recipe = "e4m3:e4m3/tensor/dynamic"
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return gm

    for vary, want in ((True, [1, None, None]), (False, [None, None])):
        module = Fp8Linear(32, 16, config=native_config(recipe, "bf16", "bf16").replace(
            tokens_vary=vary))  # fmt: skip
        graphs.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(module, backend=capture, dynamic=True)(torch.randn(21, 32))
        dims = sorted(
            (n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
             for gm in graphs for n in gm.graph.nodes if n.target == "amax"),
            key=lambda d: d is None,
        )  # fmt: skip
        assert dims == want, (vary, dims)
