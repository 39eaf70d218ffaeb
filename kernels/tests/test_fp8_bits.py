"""The interpreter-only FP8 codec must agree with torch's casts bit for bit."""

import pytest
import torch
import triton
import triton.language as tl

from loka.kernels.fp8_bits import FORMAT_IDS, fp8_decode_tl, fp8_encode_tl
from loka.schema import FP8_MAX
from loka.schema.fp8 import FP8_DTYPES


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(
        out_ptr + offs, fp8_encode_tl(tl.load(x_ptr + offs, mask=offs < n), FMT), mask=offs < n
    )


@triton.jit
def _decode_kernel(c_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, fp8_decode_tl(tl.load(c_ptr + offs), FMT))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_all_codes(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](codes, out, FMT=FORMAT_IDS[fmt])
    want = codes.view(FP8_DTYPES[fmt]).float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_matches_torch_rounding(fmt):
    m = FP8_MAX[fmt]
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPES[fmt]).float()
    grid = grid[grid.isfinite()]
    g = torch.Generator().manual_seed(0)
    # Every code, every midpoint between neighbours (ties), and log-uniform values over the range.
    s = grid.sort().values
    mids = (s[1:] + s[:-1]) / 2
    rand = torch.exp(
        torch.empty(20000).uniform_(-25, float(torch.log(torch.tensor(m))), generator=g)
    )
    rand = rand * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([grid, mids, rand, torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("nan")])])
    x = x.clamp(-m, m)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _encode_kernel[(triton.cdiv(x.numel(), 4096),)](
        x, out, x.numel(), FMT=FORMAT_IDS[fmt], BLOCK=4096
    )
    want = x.to(FP8_DTYPES[fmt])
    nan = want.float().isnan()
    assert torch.equal(out.view(FP8_DTYPES[fmt]).float().isnan(), nan)
    assert torch.equal(out[~nan], want.view(torch.uint8)[~nan])
