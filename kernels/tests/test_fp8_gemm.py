import pytest
import torch

from loka.kernels import registry
from loka.kernels.fp8_gemm import mm_reference, triton_fp8_mm
from loka.kernels.fp8_gemm_tma import triton_fp8_mm_tma
from loka.kernels.quantization import quantize_with
from loka.kernels.registry import GemmSpec
from loka.schema import QuantConfig

# (M, K, N): M=1, K or N of 16, sizes that are not multiples of any tile, more than one K block.
SHAPES = [(1, 16, 16), (37, 200, 19), (130, 272, 48), (16, 384, 130)]
RECIPES = [
    ("e4m3", "e4m3", "tensor", None, None),
    ("e4m3", "e4m3", "row", None, None),
    ("e5m2", "e4m3", "row", None, None),
    ("e4m3", "e4m3", "block", (1, 128), (128, 128)),
    ("e5m2", "e4m3", "block", (1, 128), (1, 128)),
]


def operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, M)[:, None]
    w = torch.randn(N, K, generator=g) / K**0.5
    return x.bfloat16(), w.bfloat16()


def quantized(x, w, a_fmt, b_fmt, gran, a_block, b_block):
    a = quantize_with(x, QuantConfig(a_fmt, gran, a_block))
    b = quantize_with(w, QuantConfig(b_fmt, gran, b_block))
    return a, b


def assert_matches(out, ref):
    tol = 1e-2 if out.dtype == torch.bfloat16 else 1e-5
    scale = ref.float().abs().max().clamp_min(1e-30)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r[0]}:{r[1]}/{r[2]}")
def test_matches_reference(shape, recipe):
    x, w = operands(*shape)
    a, b = quantized(x, w, *recipe)
    assert_matches(triton_fp8_mm(a, b), mm_reference(a, b))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_epilogue(activation, out_dtype):
    x, w = operands(33, 96, 40, seed=1)
    a, b = quantized(x, w, "e4m3", "e4m3", "row", None, None)
    bias = torch.linspace(-1, 1, 40, dtype=torch.bfloat16)
    out = triton_fp8_mm(a, b, bias=bias, activation=activation, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_matches(out, mm_reference(a, b, bias=bias, activation=activation, out_dtype=out_dtype))


def test_fast_accum_and_precise_agree_on_cpu():
    x, w = operands(20, 300, 24, seed=2)
    a, b = quantized(x, w, "e4m3", "e4m3", "tensor", None, None)
    fast = triton_fp8_mm(a, b, fast_accum=True, out_dtype=torch.float32)
    assert_matches(fast, mm_reference(a, b, out_dtype=torch.float32))


@pytest.mark.parametrize(
    "recipe,bound",
    [(RECIPES[0], 0.06), (RECIPES[1], 0.06), (RECIPES[2], 0.12), (RECIPES[3], 0.06)],
    ids=["tensor", "row", "e5m2-row", "block"],
)
def test_error_against_the_unquantized_product_is_within_the_recipe_budget(recipe, bound):
    # Relative Frobenius error of FP8 vs the exact product of the bf16 inputs: e4m3 has 3
    # mantissa bits (about 3.7e-2 measured on normal data on the H200), e5m2 has 2.
    x, w = operands(64, 512, 64, seed=3)
    a, b = quantized(x, w, *recipe)
    exact = x.double() @ w.double().T
    err = (triton_fp8_mm(a, b, out_dtype=torch.float32).double() - exact).norm() / exact.norm()
    assert 0 < err < bound


def test_nan_in_a_row_reaches_that_row_only():
    x, w = operands(4, 64, 8, seed=4)
    x[2, 5] = float("nan")
    a, b = quantized(x, w, "e4m3", "e4m3", "row", None, None)
    out = triton_fp8_mm(a, b)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda a, b, wide: triton_fp8_mm(a, b.data), TypeError, "Fp8Tensor"),
        (lambda a, b, wide: triton_fp8_mm(a, wide), ValueError, "K differs"),
        (lambda a, b, wide: triton_fp8_mm(a, b, out_dtype=torch.float16), TypeError, "out_dtype"),
        (lambda a, b, wide: triton_fp8_mm(a, b, activation="tanh"), ValueError, "activation"),
        (lambda a, b, wide: triton_fp8_mm(a, b, bias=torch.ones(3)), ValueError, "bias"),
    ],
)
def test_bad_requests_are_refused(make, err, match):
    x, w = operands(4, 32, 8)
    a, b = quantized(x, w, "e4m3", "e4m3", "row", None, None)
    wide = quantize_with(torch.cat([w, w], 1), QuantConfig("e4m3", "row"))
    with pytest.raises(err, match=match):
        make(a, b, wide)


@pytest.mark.parametrize("shape", [(1, 16, 16), (37, 208, 24), (70, 64, 40)])
@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2]], ids=["tensor", "e5m2-row"])
def test_tma_kernel_matches_reference(shape, recipe):
    x, w = operands(*shape, seed=5)
    a, b = quantized(x, w, *recipe)
    bias = torch.linspace(-2, 2, shape[2]).bfloat16()
    out = triton_fp8_mm_tma(a, b, bias=bias, activation="gelu")
    assert_matches(out, mm_reference(a, b, bias=bias, activation="gelu"))


def test_tma_kernel_refuses_unaligned_rows():
    x, w = operands(8, 40, 16)
    a, b = quantized(x, w, "e4m3", "e4m3", "row", None, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_fp8_mm_tma(a, b)
    assert "multiple of 16" in registry.get("triton.fp8.tma").refuse(GemmSpec.of(a, b))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the branch not taken
@pytest.mark.parametrize("recipe", RECIPES[:3], ids=["tensor", "row", "e5m2-row"])
@pytest.mark.parametrize("kernel", [triton_fp8_mm, triton_fp8_mm_tma], ids=["plain", "tma"])
def test_a_finite_product_of_huge_operands_stays_finite(recipe, kernel):
    # |x| ~ 1e36 times weights of ~1e-3: the product (about 1e34) is finite in float32, but
    # the accumulator times x's inverse scale alone (about 2e33) is not.
    x, w = operands(32, 64, 16, seed=6)
    x = x.float() * 1e36
    w = w.float() * 1e-2
    a, b = quantized(x, w, *recipe)
    ref = mm_reference(a, b, out_dtype=torch.float32)
    assert torch.isfinite(ref).all() and ref.abs().max() > 1e33
    out = kernel(a, b, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert_matches(out, ref)
    # Tiny scales the other way: a product of normal size from tiny and huge operands.
    a, b = quantized(x * 1e-36 * 1e-30, w * 1e30, *recipe)
    out = kernel(a, b, out_dtype=torch.float32)
    assert_matches(out, mm_reference(a, b, out_dtype=torch.float32))
