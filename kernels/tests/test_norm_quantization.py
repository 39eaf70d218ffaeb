import pytest
import torch

from loka.kernels import norm_backward, norm_quantize
from loka.kernels.norm_quantization import norm_quantize_reference, norm_reference
from loka.kernels.quantization import quantize_reference
from loka.kernels.testing import assert_same_fp8
from loka.schema import QuantConfig


def inputs(M, N, affine, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=g) * 3 + 1).to(dtype)
    w = (torch.rand(N, generator=g) + 0.5) if affine else None
    b = torch.randn(N, generator=g) * 0.1 if affine else None
    return x, w, b


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(1, 16), (37, 100), (5, 640)])
@pytest.mark.parametrize("affine", [True, False])
def test_forward_matches_reference_and_quantizes_its_own_output_exactly(kind, shape, affine):
    x, w, b = inputs(*shape, affine)
    out = norm_quantize(x, w, b, 1e-5, kind=kind, fmt="e4m3", return_normed=True)
    y_ref, _ = norm_quantize_reference(x, w, b, 1e-5, kind=kind)
    torch.testing.assert_close(out.normed, y_ref, rtol=1e-5, atol=1e-5)
    # The FP8 output is exactly the row quantization of the float32 normed output.
    assert_same_fp8(out.q, quantize_reference(out.normed, QuantConfig("e4m3", "row")))
    xf = x.float()
    torch.testing.assert_close(
        out.rstd,
        torch.rsqrt(
            (xf - (xf.mean(1, keepdim=True) if kind == "layernorm" else 0)).pow(2).mean(1) + 1e-5
        ),
        rtol=1e-5,
        atol=0,
    )
    assert (out.mean is None) == (kind == "rmsnorm")


def test_bf16_input_and_e5m2_pow2():
    x, w, b = inputs(20, 96, True, seed=1, dtype=torch.bfloat16)
    out = norm_quantize(x, w.bfloat16(), b.bfloat16(), kind="layernorm", fmt="e5m2", pow2=True)
    assert out.normed is None and out.q.fmt == "e5m2"
    y_ref = norm_reference(x, w.bfloat16(), b.bfloat16())
    deq = out.q.dequantize()
    # e5m2 keeps 2 mantissa bits: relative error per element at most 2**-3.
    assert ((deq - y_ref).abs() <= y_ref.abs() * 2**-3 + 1e-6).all()
    assert torch.all((out.q.scale.view(torch.int32) & 0x7FFFFF) == 0)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [True, False])
def test_backward_matches_autograd(kind, affine):
    x, w, b = inputs(45, 72, affine, seed=2)
    if kind == "rmsnorm":
        b = None
    out = norm_quantize(x, w, b, kind=kind)
    dy = torch.randn(45, 72, generator=torch.Generator().manual_seed(3))
    dx, dw, db = norm_backward(dy, x, w, out.mean, out.rstd, kind=kind, has_bias=b is not None)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_() if w is not None else None
    br = b.clone().requires_grad_() if b is not None else None
    norm_reference(xr, wr, br, kind=kind).backward(dy)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-4, atol=1e-5)
    if affine:
        torch.testing.assert_close(dw, wr.grad, rtol=1e-4, atol=1e-4)
    else:
        assert dw is None
    if b is not None:
        torch.testing.assert_close(db, br.grad, rtol=1e-4, atol=1e-4)
    else:
        assert db is None


def test_constant_row_gets_finite_scale_and_nan_row_stays_nan():
    x = torch.randn(3, 32)
    x[0] = 2.0  # LayerNorm of a constant row is all zeros
    x[2, 7] = float("nan")
    out = norm_quantize(x, kind="layernorm")
    assert out.q.scale[0] == 1.0 and torch.all(out.q.data[0].float() == 0)
    assert torch.isfinite(out.q.scale).all()
    assert torch.isnan(out.q.data[2].float()).all()  # NaN spreads through its row's statistics


def test_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="kind"):
        norm_quantize(x, kind="batchnorm")
    with pytest.raises(ValueError, match="weight"):
        norm_quantize(x, torch.ones(7))
    with pytest.raises(ValueError, match="exceed"):
        norm_quantize(torch.randn(1, 20000))
    with pytest.raises(ValueError, match="rstd"):
        norm_backward(x, x, None, None, torch.ones(3), kind="rmsnorm")
