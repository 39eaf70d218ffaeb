import pytest
import torch

from loka.kernels import Backend, UnsupportedError, available, fp8_mm, registry
from loka.kernels.fp8_gemm import mm_reference
from loka.kernels.quantization import quantize_with
from loka.kernels.registry import GemmSpec, Registry, gemm_dims
from loka.schema import BF16, QuantConfig, Recipe

ROW = Recipe("e4m3", "e4m3", "row")


def test_builtin_backends_are_registered():
    names = registry.names("mm")
    assert {
        "torch.bf16",
        "torch.scaled_mm",
        "torch.scaled_mm.fast",
        "triton.fp8",
        "triton.fp8.fast",
    } <= set(names)
    assert names.index("torch.scaled_mm") < names.index("triton.fp8")  # default preference
    for b in registry.backends("mm"):
        assert b.reference is not None and b.description


def test_nothing_is_available_for_speed_on_cpu():
    assert available("cpu") == []
    reason = registry.get("triton.fp8").unavailable_reason("cpu")
    assert "CUDA" in reason


def test_gemm_dims_of_each_pass():
    assert gemm_dims("fwd", 8, 16, 32) == (8, 16, 32)
    assert gemm_dims("dgrad", 8, 16, 32) == (8, 32, 16)
    assert gemm_dims("wgrad", 8, 16, 32) == (32, 8, 16)
    with pytest.raises(ValueError, match="pass"):
        gemm_dims("bwd", 1, 1, 1)


def test_scaled_mm_refusals_name_the_reason():
    sm = registry.get("torch.scaled_mm")
    assert sm.supports(ROW, 4096, 1024, 4096) is None
    assert "multiple of 16" in sm.supports(ROW, 4096, 1000, 4096)
    # dgrad contracts over N: N=1000 breaks K alignment of the GEMM.
    assert "k=1000" in sm.supports(ROW, 4096, 1024, 1000, "dgrad")
    assert "e4m3 second operand" in sm.supports(Recipe("e4m3", "e5m2", "row"), 64, 64, 64)
    assert "e5m2 by e5m2" in sm.supports(Recipe("e5m2", "e5m2", "tensor"), 64, 64, 64)
    assert "granularity" in sm.supports(Recipe("e4m3", "e4m3", "block"), 64, 128, 128)
    assert "formats" in sm.supports(BF16, 64, 64, 64)  # bf16 recipe


def test_block_recipe_maps_weight_operands_to_128x128():
    spec = GemmSpec.for_linear(Recipe("e4m3", "e4m3", "block"), "fwd", 256, 512, 128)
    assert spec.a.block == (1, 128) and spec.b.block == (128, 128)
    wgrad = GemmSpec.for_linear(Recipe("e5m2", "e4m3", "block"), "wgrad", 256, 512, 128)
    assert (wgrad.m, wgrad.k, wgrad.n) == (128, 256, 512) and wgrad.b.block == (1, 128)
    assert registry.get("triton.fp8").refuse(spec) is None


def test_a_recipe_or_its_string_is_accepted():
    recipe = Recipe.parse("e5m2:e4m3/row/dynamic/pow2")
    assert registry.get("triton.fp8").supports(recipe, 64, 64, 64, "dgrad") is None
    assert registry.get("triton.fp8").supports(str(recipe), 64, 64, 64, "dgrad") is None


def test_fp8_mm_runs_the_default_backend_on_cpu_under_the_interpreter():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 64, generator=g), torch.randn(24, 64, generator=g)
    a, b = (
        quantize_with(x, QuantConfig("e4m3", "row")),
        quantize_with(w, QuantConfig("e4m3", "row")),
    )
    out = fp8_mm(a, b, activation="relu")
    torch.testing.assert_close(
        out.float(), mm_reference(a, b, activation="relu").float(), rtol=1e-2, atol=1e-2
    )
    bf = fp8_mm(x.bfloat16(), w.bfloat16())  # bf16 operands go to a bf16 backend
    torch.testing.assert_close(bf.float(), (x @ w.T).float(), rtol=2e-2, atol=0.1)


def test_fp8_mm_refuses_instead_of_running_wrong():
    a = quantize_with(torch.randn(4, 64), QuantConfig("e4m3", "block"))
    b = quantize_with(torch.randn(8, 64), QuantConfig("e4m3", "block", (128, 128)))
    with pytest.raises(UnsupportedError, match="does not run on CPU"):
        fp8_mm(a, b, backend="torch.scaled_mm")
    with pytest.raises(KeyError, match="no backend 'cublas'"):
        fp8_mm(a, b, backend="cublas")
    with pytest.raises(TypeError, match="must both be Fp8Tensor"):
        fp8_mm(a, torch.randn(8, 64))


def test_scaled_mm_wrapper_passes_inverse_scales():
    # torch._scaled_mm runs tensorwise on CPU, which checks the scale convention of the wrapper.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 64, generator=g) * 30, torch.randn(48, 64, generator=g) / 50
    a, b = (
        quantize_with(x, QuantConfig("e4m3", "tensor")),
        quantize_with(w, QuantConfig("e4m3", "tensor")),
    )
    bias = torch.randn(48, generator=g).bfloat16()
    out = registry.get("torch.scaled_mm").run(a, b, bias=bias, activation="gelu")
    want = mm_reference(a, b, bias=bias, activation="gelu")
    torch.testing.assert_close(
        out.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item()
    )


def test_a_registry_can_be_extended():
    reg = Registry()

    def run(a, b, *, bias=None, activation=None, out_dtype=torch.bfloat16):
        return mm_reference(a, b, bias=bias, activation=activation, out_dtype=out_dtype)

    backend = Backend(
        name="example.dequant",
        op="mm",
        run=run,
        reference=mm_reference,
        description="dequantize and multiply in torch",
        formats=frozenset({("e4m3", "e4m3")}),
        granularities=frozenset({"row"}),
        passes=frozenset({"fwd"}),
        align=(("n", 8),),
        min_capability=None,
        runs_on_cpu=True,
    )
    reg.register(backend)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(backend)
    assert reg.get("example.dequant").supports(ROW, 3, 16, 24) is None
    assert "pass 'wgrad'" in reg.get("example.dequant").supports(ROW, 3, 16, 24, "wgrad")
    assert "n=20" in reg.get("example.dequant").supports(ROW, 3, 16, 20)
    spec = GemmSpec.for_linear(ROW, "fwd", 3, 16, 24)
    assert reg.select(spec, "cpu") is backend
    with pytest.raises(UnsupportedError, match="no mm backend"):
        reg.select(GemmSpec.for_linear(BF16, "fwd", 3, 16, 24), "cpu")
    with pytest.raises(ValueError, match="unknown format"):
        reg.register(Backend("bad", "mm", run, run, "", frozenset({("fp4", "fp4")}), frozenset()))


def test_a_gpu_without_fp8_tensor_cores_is_reported_unavailable(monkeypatch):
    import importlib

    # importlib, not `import ... as`: the package exports an object named `registry` too.
    reg_mod = importlib.import_module("loka.kernels.registry")
    rt = importlib.import_module("loka.kernels.runtime")

    monkeypatch.setattr(rt, "capability", lambda device=None: (8, 0))  # an A100
    monkeypatch.setattr(reg_mod, "capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert "8.9" in registry.get("torch.scaled_mm").unavailable_reason(cuda)
    assert "8.9" in registry.get("triton.fp8").unavailable_reason(cuda)
    assert "9.0" in registry.get("triton.fp8.tma").unavailable_reason(cuda)
    assert registry.get("torch.bf16").unavailable_reason(cuda) is None
    assert available(cuda, op="mm") == ["torch.bf16", "inductor.bf16"]


def test_fp8_mm_choice_follows_registry_changes():
    # fp8_mm caches its choice per request; registering a better backend must still win.
    a = quantize_with(torch.randn(8, 32), QuantConfig("e4m3", "row"))
    b = quantize_with(torch.randn(16, 32), QuantConfig("e4m3", "row"))
    first = fp8_mm(a, b)
    marker = torch.full((8, 16), 7.0)
    best = Backend(
        "test.best", "mm", lambda *args, **kw: marker, mm_reference, "returns a marker",
        frozenset({("e4m3", "e4m3")}), frozenset({"row"}), min_capability=None,
        runs_on_cpu=True, priority=1000,
    )  # fmt: skip
    registry.register(best)
    try:
        assert fp8_mm(a, b) is marker
    finally:
        registry.unregister("test.best")
    torch.testing.assert_close(fp8_mm(a, b), first, rtol=0, atol=0)


def test_the_padded_bf16_baseline_runs_unaligned_shapes_exactly_and_refuses_aligned_ones():
    padded = registry.get("inductor.bf16")
    # Aligned dims: the plain torch.bf16 row is the same GEMM, so it is not timed twice.
    assert "aligned already" in padded.supports("bf16", 256, 1024, 512)
    assert padded.supports("bf16", 256, 1003, 512) is None
    assert padded.linear_dims(250, 1003, 509) == (256, 1008, 512)
    assert padded.supports("e4m3:e4m3/row/dynamic", 256, 1003, 512) is not None
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(13, 1003, generator=gen).to(torch.bfloat16)
    b = torch.randn(509, 1003, generator=gen).to(torch.bfloat16)
    bias = torch.randn(509, generator=gen).to(torch.bfloat16)
    want = registry.get("torch.bf16").run(a, b, bias=bias, activation="relu")
    got = padded.run(a, b, bias=bias, activation="relu")
    assert got.shape == want.shape == (13, 509)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
