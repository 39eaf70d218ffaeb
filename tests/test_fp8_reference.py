"""One FP8 quantization, pinned bit for bit across its implementations: the reference in
`loka.schema.fp8`, the kernels' reference (`loka.kernels.quantization.quantize_reference`, what the
Triton kernels are tested against), the torch-native backend, Probe's sampled-operand
quantization and the Rust cast of `loka.stats` (`fp8_quantize`, scale by scale), on data
with NaN, Inf and all-zero rows, amaxes below the floor and far above the format's range,
and ties, for every format, granularity and scale option."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import itertools

import numpy as np
import pytest
import torch

from loka.kernels.native import quantize_native
from loka.kernels.quantization import quantize_reference as kernels_reference
from loka.probe.quantize import quantize_operand
from loka.schema import QuantConfig
from loka.schema.fp8 import expand_scale, quantize_reference
from loka.stats import fp8_quantize

ROWS, COLS = 140, 300  # partial 1x128 and 128x128 blocks at both edges


def hard_matrix() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, COLS, generator=g)
    x *= torch.exp2(torch.randint(-30, 30, (ROWS, 1), generator=g).float())
    x[0] = 0.0  # an all-zero row: scale 1
    x[1, ::7] = float("nan")  # NaN passes through, amax ignores it
    x[2, 5], x[2, 200] = float("inf"), -float("inf")  # NaN (not hidden); amax ignores them
    x[3] = float("nan")  # nothing finite: scale 1
    x[4] = torch.linspace(-1e-20, 1e-20, COLS)  # amax below the floor (1e-12)
    x[5] = torch.linspace(-3e38, 3e38, COLS)  # a scale far below 1
    x[6] = 1.0 + torch.arange(COLS) % 64 / 128  # ties of both formats
    x[6, 0] = 2.0  # ...at a scale of 224 (e4m3): 1 + k/128 lands on halfway points
    x[130:, 150:] = 0.0  # a partial 128x128 block that is all zero
    x[7, 3], x[7, 4] = -0.0, 2.0**-140  # signed zero, an fp32 subnormal
    return x


CONFIGS = [
    QuantConfig(fmt, gran, block, pow2, ub)
    for fmt, (gran, block), pow2, ub in itertools.product(
        ("e4m3", "e5m2"),
        (("tensor", None), ("row", None), ("block", (1, 128)), ("block", (128, 128))),
        (False, True),
        (None, 2.0**20),
    )
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def rust_codes(x: torch.Tensor, full_scale: torch.Tensor, fmt: str, width: int) -> torch.Tensor:
    """`loka.stats.fp8_quantize` over each run of one row that shares a scale."""
    out = np.empty((ROWS, COLS), dtype=np.uint8)
    values, scales = x.numpy(), full_scale.numpy()
    for i in range(ROWS):
        for j in range(0, COLS, width):
            cols = slice(j, min(j + width, COLS))
            out[i, cols] = fp8_quantize(values[i, cols], fmt, float(scales[i, j]))
    return torch.from_numpy(out)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_implementation_quantizes_bit_for_bit_alike(config: QuantConfig) -> None:
    x = hard_matrix()
    ref = quantize_reference(x, config)
    full = expand_scale(ref.scale, ROWS, COLS, config.granularity, config.block)
    assert torch.isfinite(ref.scale).all() and (ref.scale > 0).all()
    if config.granularity == "row":
        assert ref.scale[0] == 1.0 and ref.scale[3] == 1.0  # no finite value: scale 1

    kernels = kernels_reference(x, config)
    assert torch.equal(bits(kernels.data), bits(ref.data))
    assert torch.equal(kernels.scale, ref.scale) and torch.equal(kernels.amax, ref.amax)

    probe_q, probe_scale = quantize_operand(x, config)
    assert torch.equal(bits(probe_q), bits(ref.data))
    assert torch.equal(probe_scale.expand(ROWS, COLS), full)

    width = config.block[1] if config.block is not None else COLS
    assert torch.equal(rust_codes(x, full, config.fmt, width), bits(ref.data))

    if config.granularity in ("tensor", "row"):
        data, inv = quantize_native(
            x, config.fmt, config.granularity, pow2=config.pow2, scale_ub=config.scale_ub
        )
        assert torch.equal(bits(data), bits(ref.data))
        assert torch.equal(inv.flatten(), ref.scale.reciprocal())


@pytest.mark.parametrize("amax", [2.0, 0.0, float("inf"), float("nan")])
def test_a_given_amax_sets_the_scale_alike(amax: float) -> None:
    """Delayed scaling (and Probe's full-tensor amax): the scale comes from the given amax,
    a zero, infinite or NaN one giving scale 1; the amax returned is the one measured."""
    x = hard_matrix()
    config = QuantConfig("e4m3", "tensor", pow2=True)
    given = torch.tensor([amax])
    ref = quantize_reference(x, config, given)
    assert ref.scale.item() == (128.0 if amax == 2.0 else 1.0)  # 448 / 2 = 224, rounded down
    kernels = kernels_reference(x, config, given)
    assert torch.equal(bits(kernels.data), bits(ref.data)) and torch.equal(kernels.amax, ref.amax)
    probe_q, _ = quantize_operand(x, config, tensor_amax=given)
    assert torch.equal(bits(probe_q), bits(ref.data))
    full = expand_scale(ref.scale, ROWS, COLS, "tensor", None)
    assert torch.equal(rust_codes(x, full, "e4m3", COLS), bits(ref.data))
