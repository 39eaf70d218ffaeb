"""The built-in backends, registered when loka.kernels is imported.

Priorities set the default of `fp8_mm(backend=None)`: cuBLAS/CUTLASS `_scaled_mm` where it
applies, the Triton kernel for everything else; fast-accumulation variants are registered
for the dispatcher to time but are never a default.
"""

from __future__ import annotations

import functools
import itertools

import torch

from loka.kernels.epilogue import apply_epilogue
from loka.kernels.fp8_gemm import check_fp8_request, mm_reference, triton_fp8_mm
from loka.kernels.fp8_gemm_tma import tma_refusal, triton_fp8_mm_tma
from loka.kernels.grouped_gemm import grouped_mm_reference, loop_grouped_mm, triton_grouped_mm
from loka.kernels.native import (
    NATIVE_ALIGN,
    NATIVE_BACKEND,
    NATIVE_CPU_BACKEND,
    NATIVE_FAST_BACKEND,
    native_mm,
    native_refusal,
)
from loka.kernels.registry import BF16, Backend, GemmSpec, registry
from loka.kernels.torch_gemm import (
    INDUCTOR_BF16_ALIGN,
    bf16_mm,
    padded_bf16_mm,
    scaled_mm,
    scaled_mm_refusal,
)

# The bf16 baseline of a compiled model at unaligned shapes (see `padded_bf16_mm`).
INDUCTOR_BF16_BACKEND = "inductor.bf16"
FP8_PAIRS = frozenset(itertools.product(("e4m3", "e5m2"), repeat=2))


def _scaled_mm_check(spec: GemmSpec) -> str | None:
    if spec.a.granularity != spec.b.granularity:
        return "torch._scaled_mm needs the same granularity on both operands"
    return scaled_mm_refusal(spec.a.fmt, spec.b.fmt, spec.a.granularity, spec.out_dtype)


def _native_check(spec: GemmSpec) -> str | None:
    if spec.a.granularity != spec.b.granularity:
        return f"{NATIVE_BACKEND}: needs the same granularity on both operands"
    return native_refusal(spec.a.fmt, spec.b.fmt, spec.a.granularity)


def _native_run(
    a, b, *, bias=None, activation=None, out_dtype=torch.bfloat16, fast_accum: bool = False
):
    """The native GEMM on `Fp8Tensor` operands (the bench and `fp8_mm` call it this way;
    `Fp8Linear` calls `loka.kernels.native` directly, quantization included)."""
    bias = check_fp8_request(a, b, bias, activation, out_dtype)
    row = a.granularity == "row"
    a_inv = a.inv_scale.reshape(-1, 1) if row else a.inv_scale.reshape(())
    b_inv = b.inv_scale.reshape(-1, 1) if row else b.inv_scale.reshape(())
    y = native_mm(a.data, a_inv, b.data, b_inv, bias, out_dtype, fast_accum=fast_accum)
    return apply_epilogue(y, None, activation)


def _fp8_backend(name: str, run, description: str, **fields) -> Backend:
    return Backend(
        name=name, op="mm", run=run, reference=mm_reference, description=description,
        formats=FP8_PAIRS, **fields,
    )  # fmt: skip


def _register_builtins() -> None:
    bf16 = Backend(
        name="torch.bf16",
        op="mm",
        run=bf16_mm,
        reference=mm_reference,
        description="bf16 F.linear (cuBLAS), bias fused, activation after: the baseline",
        formats=frozenset({(BF16, BF16)}),
        granularities=frozenset({"none"}),
        min_capability=None,
        runs_on_cpu=True,
    )
    registry.register(bf16, replace=True)
    inductor_bf16 = Backend(
        name=INDUCTOR_BF16_BACKEND,
        op="mm",
        run=padded_bf16_mm,
        reference=mm_reference,
        description="bf16 F.linear at M, K, N zero-padded to multiples of 8, as torch.compile "
        "runs an unaligned matmul (inductor's pad_mm): the compiled baseline where a linear's "
        "dims are unaligned; timed there only",
        formats=frozenset({(BF16, BF16)}),
        granularities=frozenset({"none"}),
        align=tuple((dim, INDUCTOR_BF16_ALIGN) for dim in ("m", "k", "n")),
        min_capability=None,
        runs_on_cpu=True,
        traceable=True,
        linear_pads=True,
        pads_only=True,
        priority=-1,
    )
    registry.register(inductor_bf16, replace=True)
    for fast in (False, True):
        suffix = ".fast" if fast else ""
        accum = "tensor-core (fast) accumulation" if fast else "float32 accumulation"
        cublas = _fp8_backend(
            f"torch.scaled_mm{suffix}",
            functools.partial(scaled_mm, fast_accum=fast),
            f"torch._scaled_mm, tensorwise (cuBLASLt) or rowwise (CUTLASS), {accum}",
            granularities=frozenset({"tensor", "row"}),
            align=(("k", 16), ("n", 16)),
            priority=5 if fast else 20,
            check=_scaled_mm_check,
        )
        triton_gemm = _fp8_backend(
            f"triton.fp8{suffix}",
            functools.partial(triton_fp8_mm, fast_accum=fast),
            f"Triton FP8 GEMM, tensor/row/block scales, fused bias+activation, {accum}",
            granularities=frozenset({"tensor", "row", "block"}),
            triton=True,
            fused_epilogue=True,
            priority=4 if fast else 10,
        )
        registry.register(cublas, replace=True)
        registry.register(triton_gemm, replace=True)
    tma = _fp8_backend(
        "triton.fp8.tma",
        triton_fp8_mm_tma,
        "persistent Triton FP8 GEMM with TMA loads (Hopper), tensor/row scales, fused epilogue",
        granularities=frozenset({"tensor", "row"}),
        align=(("k", 16), ("n", 8)),
        min_capability=(9, 0),
        triton=True,
        fused_epilogue=True,
        priority=8,
        check=lambda spec: tma_refusal(spec.k, spec.n, spec.out_dtype),
    )
    registry.register(tma, replace=True)
    native = _fp8_backend(
        NATIVE_BACKEND,
        _native_run,
        "quantization in torch ops + torch._scaled_mm, traced into the model's graph: under "
        "torch.compile inductor fuses the quantization with its neighbours (compiled plans)",
        granularities=frozenset({"tensor", "row"}),
        align=(("k", NATIVE_ALIGN), ("n", NATIVE_ALIGN)),
        linear_pads=True,
        runs_on_cpu=True,
        traceable=True,
        scalings=frozenset({"dynamic"}),
        priority=1,
        check=_native_check,
        centers=True,
    )
    registry.register(native, replace=True)
    native_fast = _fp8_backend(
        NATIVE_FAST_BACKEND,
        functools.partial(_native_run, fast_accum=True),
        "torch.native with tensor-core (fast) accumulation: torchao's forward GEMM; outside "
        "Probe's error bounds, planned only with PlanConfig.allow_fast_accum",
        granularities=frozenset({"tensor", "row"}),
        align=(("k", NATIVE_ALIGN), ("n", NATIVE_ALIGN)),
        linear_pads=True,
        traceable=True,
        scalings=frozenset({"dynamic"}),
        priority=0,
        check=_native_check,
        centers=True,
    )
    registry.register(native_fast, replace=True)
    native_cpu = _fp8_backend(
        NATIVE_CPU_BACKEND,
        _native_run,
        "torch.native on the CPU only: the same quantization, the GEMM emulated in float32 at "
        "any shape (the CPU's stand-in for Triton kernels, which only run interpreted there)",
        granularities=frozenset({"tensor", "row"}),
        runs_on_cpu=True,
        # Never on a GPU (no capability reaches this): there it is torch.native, aligned.
        min_capability=(99, 0),
        scalings=frozenset({"dynamic"}),
        check=_native_check,
        centers=True,
    )
    registry.register(native_cpu, replace=True)
    grouped_formats = FP8_PAIRS | {(BF16, BF16)}
    grouped = Backend(
        name="triton.grouped",
        op="grouped_mm",
        run=triton_grouped_mm,
        reference=grouped_mm_reference,
        description="all groups in one Triton launch, bf16 or FP8 (tensor/row), fused epilogue",
        formats=grouped_formats,
        granularities=frozenset({"tensor", "row"}),
        triton=True,
        fused_epilogue=True,
        priority=10,
    )
    loop_bf16 = Backend(
        name="torch.loop",
        op="grouped_mm",
        run=loop_grouped_mm,
        reference=grouped_mm_reference,
        description="one F.linear per group: the bf16 baseline",
        formats=frozenset({(BF16, BF16)}),
        granularities=frozenset({"none"}),
        min_capability=None,
        runs_on_cpu=True,
    )
    loop_fp8 = Backend(
        name="torch.loop.scaled_mm",
        op="grouped_mm",
        run=loop_grouped_mm,
        reference=grouped_mm_reference,
        description="one torch._scaled_mm per group: the FP8 baseline",
        formats=FP8_PAIRS,
        granularities=frozenset({"tensor", "row"}),
        align=(("k", 16), ("n", 16)),
        check=_scaled_mm_check,
    )
    for backend in (grouped, loop_bf16, loop_fp8):
        registry.register(backend, replace=True)


_register_builtins()
