"""Sign-GEMM kernels against their pure-torch references, under TRITON_INTERPRET=1."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton creates the kernels

import pytest
import torch

from loka.lordba.kernels import (
    check_packed_signs,
    check_padding_bits,
    pack_signs,
    packed_length,
    sign_down,
    sign_down_reference,
    sign_up,
    sign_up_reference,
    sign_wgrad,
    sign_wgrad_reference,
    unpack_signs,
)

# (tokens M, long axis C, rank R): tiny, non-multiples of the tiles and of 8, R above 16.
SHAPES = [(1, 1, 1), (37, 50, 5), (16, 64, 16), (21, 45, 17)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# bf16/fp16 kernels round the scaled sign tile / the left operand to the input dtype once.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.float().abs().max().clamp_min(1.0)
    error = (actual.float() - expected.float()).abs().max()
    assert error <= TOLERANCE[dtype] * scale, f"max error {error:.3g} at scale {scale:.3g}"


def _operands(rows, length, rank, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=gen).to(dtype)
    latent = torch.randn(rank, length, generator=gen)
    scale = torch.rand(length, generator=gen) + 0.5
    return x, latent, scale


def test_pack_layout_is_little_endian_bits_set_for_negative():
    values = torch.tensor([[-1.0, 2.0, 0.0, -0.0, 3.0, 4.0, 5.0, 6.0, -7.0]])
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0b00000001, 0b00000001]]  # -1 at bit 0; -7 is sign 8 -> byte 1
    assert unpack_signs(packed, 9).tolist() == [[-1, 1, 1, 1, 1, 1, 1, 1, -1]]


@pytest.mark.parametrize("length", [1, 7, 8, 9, 50, 64])
def test_pack_unpack_round_trip(length):
    values = torch.randn(3, length, generator=torch.Generator().manual_seed(length))
    packed = pack_signs(values)
    assert packed.shape == (3, packed_length(length))
    assert torch.equal(unpack_signs(packed, length), torch.where(values < 0, -1.0, 1.0))
    assert torch.equal(pack_signs(values.T.contiguous().T), packed)  # layout of input irrelevant
    check_padding_bits(packed, length)


def test_packed_sign_checks_name_the_problem():
    packed = pack_signs(torch.randn(4, 20))
    check_packed_signs(packed, 4, 20)
    with pytest.raises(TypeError, match="uint8"):
        check_packed_signs(packed.to(torch.int8), 4, 20)
    with pytest.raises(ValueError, match=r"expected shape \(4, 3\)"):
        check_packed_signs(packed[:, :2].contiguous(), 4, 20)
    with pytest.raises(ValueError, match=r"expected shape \(5, 3\)"):
        check_packed_signs(packed, 5, 20)
    with pytest.raises(ValueError, match="contiguous"):
        check_packed_signs(torch.zeros(3, 4, dtype=torch.uint8).T, 4, 20)
    corrupted = packed.clone()
    corrupted[1, -1] |= 0b1000_0000  # sign 23 of a 20-sign row
    with pytest.raises(ValueError, match="padding bits"):
        check_padding_bits(corrupted, 20)
    with pytest.raises(TypeError, match="floating-point"):
        pack_signs(torch.ones(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "length", "rank"), SHAPES)
def test_sign_down_matches_reference(rows, length, rank, dtype):
    x, latent, scale = _operands(rows, length, rank, dtype)
    packed = pack_signs(latent)
    _close(sign_down(x, packed, scale), sign_down_reference(x, packed, scale), dtype)


def test_sign_down_without_scale_and_on_strided_rows():
    x, latent, _ = _operands(19, 40, 3, torch.float32)
    wide = torch.cat([x, torch.randn(19, 9)], dim=1)[:, :40]  # row stride 49
    packed = pack_signs(latent)
    expected = x @ torch.where(latent < 0, -1.0, 1.0).T
    _close(sign_down(wide, packed), expected, torch.float32)
    _close(sign_down_reference(x, packed), expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "length", "rank"), SHAPES)
def test_sign_up_matches_reference(rows, length, rank, dtype):
    gen = torch.Generator().manual_seed(1)
    left = torch.randn(rows, rank, generator=gen)
    packed = pack_signs(torch.randn(rank, length, generator=gen))
    row_scale = torch.rand(rank, generator=gen)
    col_scale = torch.rand(length, generator=gen)
    addend = torch.randn(rows, length, generator=gen).to(dtype)
    kwargs = {"row_scale": row_scale, "col_scale": col_scale, "alpha": 0.75, "addend": addend}
    result = sign_up(left, packed, length, **kwargs)
    assert result.dtype == dtype
    _close(result, sign_up_reference(left, packed, length, **kwargs), dtype)


def test_sign_up_broadcast_addend_and_plain_product():
    gen = torch.Generator().manual_seed(2)
    left = torch.randn(9, 4, generator=gen)
    latent = torch.randn(4, 33, generator=gen)
    packed = pack_signs(latent)
    bias = torch.randn(33, generator=gen)
    signs = torch.where(latent < 0, -1.0, 1.0)
    result = sign_up(left, packed, 33, addend=bias.expand(9, -1), out_dtype=torch.float32)
    _close(result, left @ signs + bias, torch.float32)
    _close(sign_up(left, packed, 33), left @ signs, torch.float32)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "length", "rank"), SHAPES[1:])
def test_sign_wgrad_matches_reference(rows, length, rank, dtype, split):
    gen = torch.Generator().manual_seed(3)
    left = torch.randn(rows, rank, generator=gen)
    right = torch.randn(rows, length, generator=gen).to(dtype)
    latent = torch.randn(length, rank, generator=gen).T  # a transposed view, like B^T
    col_scale = torch.rand(length, generator=gen) + 0.5
    kwargs = {"col_scale": col_scale, "alpha": 0.5, "clip": 1.0}
    grad, col_grad = sign_wgrad(left, right, latent, split=split, **kwargs)
    grad_ref, col_grad_ref = sign_wgrad_reference(left, right, latent, **kwargs)
    assert grad.stride() == latent.stride() and grad.dtype == latent.dtype
    assert torch.equal(grad == 0, grad_ref == 0)  # the STE gate blocks the same entries
    _close(grad, grad_ref, dtype)
    _close(col_grad, col_grad_ref, dtype)


def test_sign_wgrad_plain_estimator_without_scale():
    gen = torch.Generator().manual_seed(4)
    left, right = torch.randn(30, 2, generator=gen), torch.randn(30, 11, generator=gen)
    latent = torch.randn(2, 11, generator=gen)
    grad, col_grad = sign_wgrad(left, right, latent, clip=math.inf)
    assert col_grad is None
    _close(grad, left.T @ right, torch.float32)


def test_launchers_reject_bad_operands(monkeypatch):
    x, latent, scale = _operands(8, 24, 4, torch.float32)
    packed = pack_signs(latent)
    with pytest.raises(ValueError, match=r"expected shape \(4, 4\)"):
        sign_down(torch.randn(8, 32), packed)  # packed for 24 signs, x has 32 columns
    with pytest.raises(TypeError, match="uint8"):
        sign_down(x, packed.to(torch.int16))
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        sign_down(x.to(torch.int32), packed)
    with pytest.raises(ValueError, match=r"col_scale: expected shape \(24,\)"):
        sign_down(x, packed, scale[:10])
    with pytest.raises(ValueError, match=r"expected shape \(3, 3\)"):
        sign_up(torch.randn(8, 3), packed, 24)  # rank 3 against 4 packed rows
    with pytest.raises(ValueError, match=r"addend: expected shape \(8, 24\)"):
        sign_up(torch.randn(8, 4), packed, 24, addend=torch.randn(8, 23))
    with pytest.raises(ValueError, match=r"latent: expected shape \(4, 24\)"):
        sign_wgrad(torch.randn(8, 4), x, latent.T)
    monkeypatch.setattr("loka.kernels.runtime._INTERPRETING", False)
    with pytest.raises(RuntimeError, match="need a CUDA GPU, or TRITON_INTERPRET=1"):
        sign_down(x, packed)


def test_registered_backends():
    from loka.kernels import registry

    for op, kernel, reference in [
        ("sign_down", sign_down, sign_down_reference),
        ("sign_up", sign_up, sign_up_reference),
        ("sign_wgrad", sign_wgrad, sign_wgrad_reference),
    ]:
        assert registry.names(op) == [f"triton.{op}", f"torch.{op}"]
        assert registry.get(f"triton.{op}").run is kernel
        assert registry.get(f"torch.{op}").run is reference
