"""Helpers for testing LoKA integrations without a GPU.

`synthetic_kernel_bench` makes a kernel_bench table in which chosen FP8 recipes win at
chosen shapes, so that a plan with FP8 sites can be made, applied and trained on the CPU
(FP8 then runs through Triton's interpreter: tiny shapes only). Its rows say what they
are: device "synthetic", `estimated=True`, source "loka.dispatch.testing".
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from loka.dispatch.bench.candidates import (
    LAYER_NORM_BACKEND,
    NORM_QUANTIZE_BACKEND,
    fusable,
    m_bucket,
)
from loka.schema import PASSES, validate

SYNTHETIC_DEVICE = {
    "device": "synthetic", "capability": "none", "driver": "none", "torch_version": "none",
    "triton_version": "none",
}  # fmt: skip


def synthetic_kernel_bench(
    shapes: Iterable[tuple[int, int, int]],
    recipes: dict[str, str] | None = None,
    *,
    backend: str = "triton.fp8",
    bf16_ms: float = 1.0,
    fp8_ms: float = 0.5,
    norm_shapes: Iterable[tuple[int, int]] = (),
    norm_ms: float = 0.2,
) -> pl.DataFrame:
    """Rows at each (M, K, N): bf16 at `bf16_ms` for every pass, and `recipes[pass]` on
    `backend` at `fp8_ms` (default recipe: e4m3:e4m3/row/dynamic in every pass). At each
    `norm_shapes` (M, K): a LayerNorm row at `norm_ms` and a fused norm+quantize row at
    0.8 `norm_ms` for the forward recipe (when it is rowwise and dynamic)."""
    recipes = recipes or dict.fromkeys(PASSES, "e4m3:e4m3/row/dynamic")
    rows = []
    for M, K, N in shapes:
        for pass_ in PASSES:
            base = {**SYNTHETIC_DEVICE, "pass": pass_, "M_bucket": m_bucket(M), "K": K, "N": N,
                    "groups": 1, "tflops": 0.0, "estimated": True, "method": "synthetic",
                    "source": "loka.dispatch.testing"}  # fmt: skip
            rows.append({**base, "backend": "torch.bf16", "recipe": "bf16", "median_ms": bf16_ms,
                         "gemm_ms": bf16_ms, "quant_ms": 0.0})  # fmt: skip
            if pass_ in recipes:
                rows.append({**base, "backend": backend, "recipe": recipes[pass_],
                             "median_ms": fp8_ms, "gemm_ms": fp8_ms * 0.8,
                             "quant_ms": fp8_ms * 0.2})  # fmt: skip
    for M, K in norm_shapes:
        base = {**SYNTHETIC_DEVICE, "pass": "fwd", "M_bucket": m_bucket(M), "K": K, "N": 0,
                "groups": 1, "tflops": 0.0, "estimated": True, "method": "synthetic",
                "source": "loka.dispatch.testing", "quant_ms": 0.0}  # fmt: skip
        rows.append({**base, "backend": LAYER_NORM_BACKEND, "recipe": "bf16",
                     "median_ms": norm_ms, "gemm_ms": norm_ms})  # fmt: skip
        if "fwd" in recipes and fusable(recipes["fwd"]):
            rows.append({**base, "backend": NORM_QUANTIZE_BACKEND, "recipe": recipes["fwd"],
                         "median_ms": 0.8 * norm_ms, "gemm_ms": 0.8 * norm_ms})  # fmt: skip
    return validate(pl.DataFrame(rows), "kernel_bench")
