import pytest
import torch

from loka.kernels import UnsupportedError, grouped_mm, registry
from loka.kernels.grouped_gemm import grouped_mm_reference, triton_grouped_mm
from loka.kernels.quantization import quantize_with
from loka.schema import QuantConfig

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


def test_stacked_views_are_recognised_without_copies():
    from loka.kernels.grouped_gemm import stacked_view

    buf = torch.randn(5, 12, 8)
    views = list(buf.unbind(0))
    stacked = stacked_view(views)
    assert stacked is not None and stacked.data_ptr() == buf.data_ptr()
    assert torch.equal(stacked, buf)
    assert stacked_view(views[::2]) is not None  # a constant step of two matrices
    assert stacked_view([buf[0], buf[2], buf[3]]) is None  # uneven steps
    assert stacked_view([torch.randn(12, 8) for _ in range(3)]) is None  # separate tensors
    assert stacked_view([buf[0], buf[1, :6]]) is None  # different shapes
    side_by_side = torch.randn(2, 12, 8)
    # Equal steps inside one storage but past the first view's storage are refused by torch.
    assert stacked_view([side_by_side[1], torch.randn(12, 8)]) is None


def test_batched_path_matches_the_reference():
    from loka.kernels.grouped_gemm import _batched_mm

    g = torch.Generator().manual_seed(5)
    a3, b3 = torch.randn(4, 24, 32, generator=g), torch.randn(4, 16, 32, generator=g)
    bias = [torch.randn(16, generator=g) for _ in range(4)]
    got = _batched_mm(a3, b3, bias, "gelu", torch.float32)
    want = grouped_mm_reference(list(a3), list(b3), bias=bias, activation="gelu",
                                out_dtype=torch.float32)  # fmt: skip
    assert_groups_match(got, want, 1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_groups_of_one_shape_take_the_uniform_grid(fp8):
    a, b = groups([(40, 48, 24)] * 3, seed=3)
    if fp8:
        cfg = QuantConfig("e4m3", "row")
        a, b = [quantize_with(t, cfg) for t in a], [quantize_with(t, cfg) for t in b]
    assert_groups_match(triton_grouped_mm(a, b), grouped_mm_reference(a, b), 1e-2)
