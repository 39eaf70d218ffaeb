"""The fused LoRDBA forward kernel (down + rank scale + up in one launch) against its
pure-torch reference under TRITON_INTERPRET=1, and against LoRDBALinear's own forward."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from loka.lordba import LoRDBAConfig, LoRDBALinear
from loka.lordba.kernels import fused, pack_signs


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fused._sign_adapter_kernel, InterpretedFunction)


pytestmark = pytest.mark.skipif(
    not (_interpreted() or torch.cuda.is_available()),
    reason="loka.lordba.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("m", "k", "n", "r", "dtype", "scales", "addend"),
    [
        (37, 45, 70, 5, torch.float32, True, True),  # every axis off its tile and its byte
        (16, 64, 32, 20, torch.float32, False, False),  # rank above 16
        (9, 40, 33, 8, torch.bfloat16, True, True),
        (5, 24, 17, 3, torch.float16, True, False),
    ],
)
def test_sign_adapter_matches_reference(m, k, n, r, dtype, scales, addend):
    gen = torch.Generator().manual_seed(m + k + n + r)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    packed_a = pack_signs(torch.randn(r, k, generator=gen)).to(DEVICE)
    packed_b = pack_signs(torch.randn(r, n, generator=gen)).to(DEVICE)
    options = {"alpha": 0.7}
    if scales:
        options |= {
            "in_scale": torch.rand(k, generator=gen).to(DEVICE) + 0.5,
            "rank_scale": torch.rand(r, generator=gen).to(DEVICE) / k**0.5,
            "col_scale": torch.rand(n, generator=gen).to(DEVICE) + 0.5,
        }
    if addend:
        options["addend"] = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    out = fused.sign_adapter(x, packed_a, packed_b, n, **options)
    expected = fused.sign_adapter_reference(x, packed_a, packed_b, n, **options)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out, expected, **tol)


def test_reference_is_the_modules_adapter_and_checks_operands():
    torch.manual_seed(0)
    module = LoRDBALinear(nn.Linear(24, 20), LoRDBAConfig(rank=4, input_scale=True))
    with torch.no_grad():
        module.scale_out.uniform_(0.5, 1.5)
        module.scale_in.uniform_(0.5, 1.5)
    x = torch.randn(7, 24)
    packed = module.packed_signs()
    options = {
        "in_scale": module.scale_in.detach(),
        "rank_scale": module.scale_rank.detach(),
        "col_scale": module.scale_out.detach(),
        "alpha": module.scaling,
    }
    with torch.no_grad():
        base = module.base(x)
        expected = module(x)
    for run in (fused.sign_adapter, fused.sign_adapter_reference):
        out = run(x, packed.a, packed.b, 20, addend=base, **options)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed_b"):
        fused.sign_adapter_reference(x, packed.a, packed.b, 25)


@pytest.mark.parametrize("split_n", [1, 3, 8])
def test_column_ranges_cover_every_column_once(monkeypatch, split_n):
    """SPLIT_N column ranges per row block (few tokens: more programs); 100 columns are 4
    tiles of 32 under the interpreter: 1, 2 (not 3: none may be empty) and 4 ranges."""
    tiles = 4
    ranges = fused.column_ranges(100, 32, split_n)
    assert ranges == {1: 1, 3: 2, 8: 4}[split_n]
    per = -(-tiles // ranges)
    assert (ranges - 1) * per < tiles <= ranges * per
    config = fused.triton.Config({**fused._INTERPRETED.kwargs, "SPLIT_N": split_n})
    monkeypatch.setattr(fused, "_INTERPRETED", config)
    gen = torch.Generator().manual_seed(split_n)
    x = torch.randn(21, 40, generator=gen).to(DEVICE)
    packed_a = pack_signs(torch.randn(6, 40, generator=gen)).to(DEVICE)
    packed_b = pack_signs(torch.randn(6, 100, generator=gen)).to(DEVICE)
    options = {"col_scale": torch.rand(100, generator=gen).to(DEVICE), "alpha": 0.5}
    options["addend"] = torch.randn(21, 100, generator=gen).to(DEVICE)
    out = fused.sign_adapter(x, packed_a, packed_b, 100, **options)
    expected = fused.sign_adapter_reference(x, packed_a, packed_b, 100, **options)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
