"""`torch.library.opcheck` on every `loka_mods::*` op over the configs the planner chooses:
schema (no output aliases an input or another output, mutations as declared), fake-tensor
implementation against the real one, autograd registration, and AOT dispatch with dynamic
shapes. Also the aliasing rules torch.compile enforces, checked directly on the outputs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import pytest
import torch

from loka.mods import ops
from loka.schema import QuantConfig

OP = torch.ops.loka_mods
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(autouse=True)
def bitwise_fp8_allclose(monkeypatch):
    """opcheck's schema check finds mutated inputs by comparing them before and after with
    ``torch.allclose``, which torch does not implement for FP8 on the CPU; compare FP8
    tensors bit for bit instead (what the check means: unchanged bytes)."""
    allclose = torch.allclose

    def patched(a, b, *args, **kwargs):
        if a.dtype in FP8 and b.dtype in FP8:
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", patched)


def cfg(fmt="e4m3", granularity="row", block=None, pow2=False, ub=None) -> str:
    return str(QuantConfig(fmt, granularity, block, pow2, ub))


def sample(rows, cols, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, cols)
    return x.requires_grad_(requires_grad)


def storages(tensors):
    return [t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()]


def assert_no_alias(outputs, inputs):
    """What custom ops promise torch.compile: no output shares memory with an input or
    another output."""
    outs = storages(outputs)
    assert len(set(outs)) == len(outs), "outputs alias each other"
    assert not set(outs) & set(storages(inputs)), "an output aliases an input"


# (config, delayed): granularity tensor/row/block, both formats, delayed only for tensor
# (the only granularity delayed recipes run), pow2 and a scale upper bound.
QUANT_CASES = {
    "e4m3-tensor-dynamic": (cfg("e4m3", "tensor"), False),
    "e5m2-tensor-delayed": (cfg("e5m2", "tensor"), True),
    "e4m3-tensor-delayed-pow2-ub": (cfg("e4m3", "tensor", pow2=True, ub=64.0), True),
    "e4m3-row": (cfg("e4m3", "row"), False),
    "e5m2-row-pow2": (cfg("e5m2", "row", pow2=True), False),
    "e4m3-block1x128": (cfg("e4m3", "block", (1, 128)), False),
    "e5m2-block128x128-ub": (cfg("e5m2", "block", (128, 128), ub=1e4), False),
}
PADS = {"unpadded": (0, 0), "padded": (16, 128)}


def quant_args(name, pad, transpose=False):
    config, delayed = QUANT_CASES[name]
    granularity = ops.decode(config).granularity
    R, C = (16, 128) if granularity == "block" else (16, 32)
    x = sample(R, C, requires_grad=True)
    amax = torch.tensor([3.0]) if delayed else None
    dr, dc = PADS[pad]
    return x, config, amax, R + dr, C + dc


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantize(name, pad):
    args = quant_args(name, pad)
    torch.library.opcheck(OP.quantize, args)
    assert_no_alias(OP.quantize(*args), [args[0], args[2]])


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantize_transpose(name, pad):
    args = quant_args(name, pad)
    torch.library.opcheck(OP.quantize_transpose, args)
    assert_no_alias(OP.quantize_transpose(*args), [args[0], args[2]])


def operand(rows, cols, config, seed):
    data, _, inv, _ = ops.quantize_impl(sample(rows, cols, seed), config, None, rows, cols)
    return data, inv


# (a config, b config): the GEMMs a plan makes (block: 1x128 activations, 128x128 weights).
MM_CASES = {
    "tensor-e4m3": (cfg("e4m3", "tensor"), cfg("e4m3", "tensor")),
    "row-e5m2-e4m3": (cfg("e5m2", "row"), cfg("e4m3", "row")),
    "block": (cfg("e4m3", "block", (1, 128)), cfg("e4m3", "block", (128, 128))),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", MM_CASES)
def test_mm(name, bias):
    a_config, b_config = MM_CASES[name]
    M, K, N = 16, 128, 32
    a_data, a_inv = operand(M, K, a_config, 1)
    b_data, b_inv = operand(N, K, b_config, 2)
    b = torch.randn(N, requires_grad=True) if bias else None
    args = (a_data, a_inv, a_config, b_data, b_inv, b_config, b, "", torch.bfloat16)
    torch.library.opcheck(OP.mm, args)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm(bias):
    G, M, K, N = 2, 16, 32, 16
    a_config, b_config = cfg("e4m3", "row"), cfg("e4m3", "row")
    a_data, a_inv = operand(G * M, K, a_config, 1)
    b_data, b_inv = operand(G * N, K, b_config, 2)
    b = torch.randn(G, N, requires_grad=True) if bias else None
    args = (a_data, a_inv, a_config, b_data, b_inv, b_config, G, b, "", torch.bfloat16)
    torch.library.opcheck(OP.grouped_mm, args)


# (kind, affine weight, bias, config, return_normed, padded cols)
NORM_CASES = {
    "layernorm-affine-normed": ("layernorm", True, True, cfg("e4m3", "row"), True, 32),
    "layernorm-plain-padded": ("layernorm", False, False, cfg("e5m2", "row"), False, 48),
    "rmsnorm-pow2-ub": ("rmsnorm", True, False, cfg("e4m3", "row", pow2=True, ub=64.0), False, 32),
    "rmsnorm-plain-normed": ("rmsnorm", False, False, cfg("e4m3", "row"), True, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NORM_CASES)
def test_norm_quantize(name, dtype):
    kind, affine, has_bias, config, normed, cols = NORM_CASES[name]
    x = sample(16, 32).to(dtype).requires_grad_(True)
    w = torch.rand(32, requires_grad=True) + 0.5 if affine else None
    b = torch.randn(32, requires_grad=True) if has_bias else None
    args = (x, w, b, 1e-5, kind, config, normed, cols)
    torch.library.opcheck(OP.norm_quantize, args)
    assert_no_alias(OP.norm_quantize(*args), [t for t in (x, w, b) if t is not None])


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_backward(kind, affine, has_bias):
    x = sample(16, 32, seed=1)
    w = torch.rand(32) + 0.5 if affine else None
    out = ops.norm_quantize_impl(x, w, None, 1e-5, kind, cfg(), False, 32)
    mean = out[5] if kind == "layernorm" else None
    dy = sample(16, 32, seed=2).requires_grad_(True)
    args = (dy, x, w, mean, out[6], kind, has_bias)
    torch.library.opcheck(OP.norm_backward, args)
    inputs = [t for t in (dy, x, w, mean, out[6]) if t is not None]
    assert_no_alias(OP.norm_backward(*args), inputs)


def cache_for(fwd, dgrad, rows, cols):
    cache = []
    for text, r, c in ((fwd, rows, cols), (dgrad, cols, rows)):
        if not text:
            cache += [torch.empty(0) for _ in range(4)]
            continue
        config = ops.decode(text)
        grid = config.scale_shape(r, c)
        cache += [torch.empty((r, c), dtype=config.dtype)] + [torch.empty(grid) for _ in range(3)]
    return cache


# (fwd config, dgrad config, fwd delayed, dgrad delayed, padded): shared layouts go through
# quantize_transpose, different ones through two quantizes; "" skips a layout.
REFRESH_CASES = {
    "row-shared": (cfg("e4m3", "row"), cfg("e4m3", "row"), False, False, False),
    "tensor-delayed-shared-padded": (
        cfg("e4m3", "tensor"),
        cfg("e4m3", "tensor"),
        True,
        True,
        True,
    ),
    "tensor-delayed-fwd-only-dgrad": (
        cfg("e4m3", "tensor"),
        cfg("e5m2", "tensor"),
        True,
        False,
        False,
    ),
    "block-fwd-only": (cfg("e4m3", "block", (128, 128)), "", False, False, False),
}


@pytest.mark.parametrize("name", REFRESH_CASES)
def test_refresh_weight(name):
    fwd, dgrad, fwd_delayed, dgrad_delayed, padded = REFRESH_CASES[name]
    N, K = (128, 128) if "block" in name else (16, 32)
    rows, cols = (N + 16, K + 32) if padded else (N, K)
    weight = torch.nn.Parameter(sample(N, K, seed=3))
    history = torch.zeros(4) if fwd_delayed or dgrad_delayed else torch.zeros(0)
    key = torch.full((3,), -1, dtype=torch.int64)
    args = (weight, key, cache_for(fwd, dgrad, rows, cols), history, fwd, dgrad,
            fwd_delayed, dgrad_delayed, rows, cols)  # fmt: skip
    torch.library.opcheck(OP.refresh_weight, args)
    # It did the refresh (opcheck runs it on copies of the mutable arguments too): the key
    # holds the weight's stamp and a delayed history its amax.
    OP.refresh_weight(*args)
    assert int(key[0]) >= 0
    if history.numel():
        assert float(history[0]) == pytest.approx(float(weight.detach().abs().max()))


@pytest.mark.parametrize("name", MM_CASES)
def test_eager_mm_wraps_its_own_operands_unchecked_and_the_op_still_checks(name):
    # `call("mm")` (eager autograd functions) skips Fp8Tensor's checks on operands this
    # module's ops made: the same product as the op, whose callers still get the clear errors.
    a_config, b_config = MM_CASES[name]
    a_data, a_inv = operand(16, 128, a_config, 1)
    b_data, b_inv = operand(32, 128, b_config, 2)
    args = (a_data, a_inv, a_config, b_data, b_inv, b_config, None, "", torch.bfloat16)
    assert torch.equal(ops.call("mm", *args), OP.mm(*args))
    bad = (a_data.view(torch.uint8), *args[1:])
    with pytest.raises(TypeError, match=r"Fp8Tensor data is torch\.uint8"):
        OP.mm(*bad)
    short = (a_data, a_inv[:-1] if a_inv.numel() > 1 else a_inv.expand(2), *args[2:])
    with pytest.raises(ValueError, match=r"Fp8Tensor\.scale must be float32 of shape"):
        OP.mm(*short)
