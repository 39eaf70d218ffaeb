import pytest
import torch

from loka.kernels import QuantConfig, UnsupportedError, grouped_mm, quantize_with, registry
from loka.kernels.grouped_gemm import grouped_mm_reference, triton_grouped_mm

# Different M, N and K per group, including M=1, K=16 and sizes off every tile.
SHAPES = [(1, 16, 16), (40, 48, 24), (70, 130, 33), (16, 16, 100)]


def groups(shapes, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(m, k, generator=g).to(dtype) for m, k, _ in shapes]
    b = [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for _, k, n in shapes]
    return a, b


def assert_groups_match(got, want, tol):
    assert len(got) == len(want)
    for o, r in zip(got, want, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        scale = r.float().abs().max().clamp_min(1e-30)
        torch.testing.assert_close(o.float(), r.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_high_precision_groups_of_different_shapes(dtype):
    a, b = groups(SHAPES, dtype)
    bias = [torch.randn(n).to(dtype) for _, _, n in SHAPES]
    got = triton_grouped_mm(a, b, bias=bias, activation="silu", out_dtype=torch.float32)
    assert_groups_match(
        got,
        grouped_mm_reference(a, b, bias=bias, activation="silu", out_dtype=torch.float32),
        1e-4 if dtype == torch.float32 else 1e-2,
    )


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_groups(granularity):
    a, b = groups(SHAPES, seed=1)
    qa = [quantize_with(t, QuantConfig("e4m3", granularity)) for t in a]
    qb = [quantize_with(t, QuantConfig("e4m3", granularity)) for t in b]
    got = grouped_mm(qa, qb)  # default backend: the Triton grouped kernel under the interpreter
    assert_groups_match(got, grouped_mm_reference(qa, qb), 1e-2)


def test_equal_shapes_and_many_groups():
    a, b = groups([(8, 32, 16)] * 9, seed=2)
    assert_groups_match(
        grouped_mm(a, b, activation="relu"), grouped_mm_reference(a, b, activation="relu"), 1e-2
    )


def test_bad_groups_are_refused():
    a, b = groups(SHAPES[:2])
    with pytest.raises(ValueError, match="one length"):
        grouped_mm(a, b[:1])
    with pytest.raises(ValueError, match="K differs"):
        grouped_mm(a, b[::-1])
    qa = [quantize_with(t, QuantConfig("e4m3", "block")) for t in a]
    qb = [quantize_with(t, QuantConfig("e4m3", "block", (128, 128))) for t in b]
    with pytest.raises(UnsupportedError, match="granularity"):
        grouped_mm(qa, qb, backend="triton.grouped")
    assert registry.get("torch.loop").runnable_reason("cpu") is None
    assert_groups_match(grouped_mm(a, b, backend="torch.loop"), grouped_mm_reference(a, b), 2e-2)
